"""The workload YAMLs' node setup, run for real up to the CUDA compile (NODE_SETUP_DRY_RUN=1), through
tools/run_workload.py as a user's own machine runs it: the build-tool check, the pinned installs resolved by pip
against the package index, the causal-conv1d sdist download and the patch that restricts its build to one GPU
architecture. Only the compile and the final installs are left out; the whole setup ran end to end on an H200
(docs/BENCHMARKS.md: "Node setup", for sm_90; the twenty-seventh round, through workload.yaml for sm_103, before a
B300 got sm_100 code).
The pins are the same lines as requirements.txt's."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, fake_cuda_home
from packaging.version import Version

WORKLOADS = sorted(ROOT.glob("*.yaml"))
VENV_BIN = Path(sys.executable).parent


def dry_run(tmp_path: Path, workload: Path = ROOT / "workload.yaml", **env) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "WHEEL_CACHE": str(tmp_path / "wheel-cache"),
        "TMPDIR": str(tmp_path),
        **env,
    }
    command = [sys.executable, str(ROOT / "tools/run_workload.py"), str(workload), "--setup-only", "--dry-run"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def nvcc_flags(setup_py: Path) -> list[str]:
    """The -gencode flags causal-conv1d's setup.py hands nvcc, evaluated from its own code (CUDA 13, no ROCm):
    the lines from `cc_flag = []` to the point where they are used, where the patch goes."""
    text = setup_py.read_text()
    start, end = text.index("    cc_flag = []"), text.index("    # HACK: The compiler flag")
    scope = {
        "HIP_BUILD": False,
        "CUDA_HOME": None,  # skips its nvcc -V; the version is given
        "bare_metal_version": Version("13.0"),
        "Version": Version,
        "check_if_cuda_home_none": lambda name: None,
        "PACKAGE_NAME": "causal_conv1d",
    }
    exec(textwrap.dedent(text[start:end]), scope)
    return scope["cc_flag"]


@pytest.mark.parametrize("gpu, arch", [("90", "90"), ("100", "100"), ("103", "100")])
def test_dry_run_resolves_the_installs_and_patches_causal_conv1d_for_this_gpu_only(gpu, arch, tmp_path):
    """A B300 (103) gets sm_100 code: nvcc 13's sm_103 build of causal-conv1d's forward computes wrong values
    (causal-conv1d issue #105), and a B300 runs sm_100's; its cache key says so (no wheel built before is reused)."""
    proc = dry_run(tmp_path, GPU_ARCH=gpu, CUDA_HOME=str(fake_cuda_home(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    would_install = re.search(r"^Would install (.*)$", proc.stdout, re.M)
    assert would_install and "flash-linear-attention-0.6.0" in would_install[1], proc.stdout[-3000:]
    # tilelang only where fla's Triton backward is refused: Hopper (this venv has Triton 3.6.0: requirements-dev.txt)
    assert ("tilelang-0.1.15" in would_install[1]) == (arch == "90")
    src = re.search(rf"^dry run: would compile (\S+) for sm_{arch} and install it", proc.stdout, re.M)
    assert src and re.search(rf"causal-conv1d-1.7.0-\S+-sm{arch} \(once per", proc.stdout), proc.stdout[-2000:]
    upstream = nvcc_flags(Path(src[1]) / "setup.py.orig")
    assert f"arch=compute_{arch},code=sm_{arch}" in upstream and len(upstream) > 2  # it builds for many
    assert nvcc_flags(Path(src[1]) / "setup.py") == ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


def test_a_cached_build_is_installed_without_build_tools(tmp_path):
    first = dry_run(tmp_path, GPU_ARCH="90", CUDA_HOME=str(fake_cuda_home(tmp_path)))
    cache = Path(re.search(r"into (\S+) \(once per", first.stdout)[1])
    cache.mkdir(parents=True)
    (cache / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    again = dry_run(tmp_path, GPU_ARCH="90", CUDA_HOME=str(tmp_path / "no-cuda"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "would install the cached" in again.stdout and "building causal-conv1d" not in again.stdout


def test_missing_nvcc_is_named_before_anything_is_installed(tmp_path):
    tools = tmp_path / "bin"  # a PATH with what the setup needs up to its check, and no nvcc
    tools.mkdir()
    for name in ("bash", "grep", "ls", "sed", "cat"):
        (tools / name).symlink_to(shutil.which(name))
    (tools / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # a link would lose the venv
    (tools / "python").chmod(0o755)
    proc = dry_run(tmp_path, GPU_ARCH="90", CUDA_HOME=str(tmp_path / "no-cuda"), PATH=str(tools))
    assert proc.returncode == 1
    assert "building causal-conv1d needs:" in proc.stderr and "nvcc (the CUDA compiler" in proc.stderr
    assert "Would install" not in proc.stdout and "Looking in" not in proc.stdout


def test_a_wheel_cache_this_node_cannot_write_is_named_before_the_build(tmp_path):
    """The YAML's WHEEL_CACHE left at a volume path that is not there: said before the installs and the ~7 minute
    compile, not by a failed install of the cached wheel after it."""
    (tmp_path / "a-file").write_text("")
    proc = dry_run(tmp_path, GPU_ARCH="90", CUDA_HOME=str(fake_cuda_home(tmp_path)), WHEEL_CACHE=f"{tmp_path}/a-file/x")
    assert proc.returncode == 1 and "a folder this node can write at WHEEL_CACHE" in proc.stderr, proc.stderr[-2000:]
    assert "Would install" not in proc.stdout and "building causal-conv1d" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_no_gpu_and_no_gpu_arch_stops_with_what_to_set(tmp_path):
    proc = dry_run(tmp_path)
    assert proc.returncode != 0 and "set GPU_ARCH" in proc.stderr, proc.stderr[-2000:]


def test_a_dense_model_workload_resolves_only_the_pins(tmp_path):
    proc = dry_run(tmp_path, ROOT / "llama3.1-8b-2x8xH100.yaml")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: the pinned packages resolve; nothing installed" in proc.stdout
    assert "flash-linear-attention" not in proc.stdout and "causal-conv1d" not in proc.stdout


def yaml_pins(workload: Path) -> dict:
    """{package: version} of the pins=... (and pins+=...) lines of a workload's command."""
    command = yaml.safe_load(workload.read_text())["command"]
    text = " ".join(re.findall(r'pins\+?="([^"]*)"', command))
    return dict(pin.split("==") for pin in text.split())


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda p: p.name)
def test_the_workload_pins_are_requirements_txt(workload):
    """The node installs what the tests ran with: requirements.txt less torch (a node keeps its image's CUDA
    torch). A pin changed in one place and not the other fails here."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    required = dict(line.split("==") for line in lines if "==" in line and not line.startswith(("#", "torch==")))
    assert yaml_pins(workload) == required


def test_the_kernel_versions_train_py_asks_for_are_the_ones_the_setup_installs():
    command = yaml.safe_load((ROOT / "workload.yaml").read_text())["command"]
    source = (ROOT / "train.py").read_text()
    for package in ("tilelang", "flash-linear-attention"):
        setup = re.search(rf"{package}==([\d.]+)", command)[1]
        asked = set(re.findall(rf"pip install {package}==([\d.]+)", source))
        assert asked == {setup}, (package, asked, setup)  # named, and the same
    conv = re.search(r"conv=([\d.]+)", command)[1]
    assert set(re.findall(r"build causal-conv1d ([\d.]+) against", source)) == {conv}
