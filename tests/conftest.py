"""Shared by the tests: paths, the tiny model, the CPU training job, the torchrun launcher. pyproject.toml puts
the repo root and tools/ on the import path (pytest's pythonpath); workers under torchrun get them through
PYTHONPATH."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "ultrachat_sample.jsonl"
WORKERS = ROOT / "tests" / "workers"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def free_port() -> int:  # for a server or a rendezvous a test starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra) -> dict:
    """The environment of a process a test starts: train and tools importable, one thread per CPU rank."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def run(command: list, env: dict | None = None, timeout=300) -> tuple[int, str, str]:
    """Runs command in the repo root (environment: worker_env() unless given): (exit status, stdout, stderr)."""
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or worker_env())
    return proc.returncode, proc.stdout, proc.stderr


def run_ok(command: list, env: dict | None = None, timeout=300) -> str:
    """run(), failing the test if the command fails; its stdout."""
    rc, out, err = run(command, env, timeout)
    assert rc == 0, out[-3000:] + err[-5000:]
    return out


def torchrun(*args, timeout=300, env=None) -> str:
    """Runs args (a script and its arguments) on 2 CPU ranks under torchrun; fails the test if it fails."""
    return run_ok([*TORCHRUN, *map(str, args)], worker_env(**(env or {})), timeout)


def write_tiny_job(path: Path, tiny_model_dir, **settings) -> Path:
    """A CPU training job on the tiny model as a YAML file for --config: what every test that trains shares,
    then its own settings (which may override these)."""
    job = {
        "model_name": str(tiny_model_dir),
        "model_revision": "",
        "compile": False,  # torch.compile pays off on GPUs; on CPU it would only add compile time
        "attn_implementation": "sdpa",
        "dataset_name": str(SAMPLE),
        "max_seq_len": 1024,
        "num_workers": 0,
        **settings,
    }
    if "datasets" in settings:  # several sources instead of dataset_name
        del job["dataset_name"]
    path.write_text(yaml.safe_dump(job))
    return path


def fake_cuda_home(tmp_path: Path) -> Path:
    """An nvcc that only answers --version: CI has no CUDA toolkit, and the dry run compiles nothing."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    return home


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from make_tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def conversations():
    return [json.loads(line)["messages"] for line in open(SAMPLE)]


@pytest.fixture()
def world_of_one(tmp_path):
    """A process group of this process alone (gloo), for the functions that take a Dist and run collectives."""
    import torch
    import torch.distributed as dist

    import train

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield train.Dist(0, 1, torch.device("cpu"), owns_group=True)
    dist.destroy_process_group()


def stream_blocks(cfg, tokenizer, progress, resume=None, n=None) -> list:
    """The input_ids of rank 0 of 1's first n blocks (all if None) through block_loader, recorded in progress."""
    import itertools

    import train

    loader = train.block_loader(cfg, tokenizer, "train", 0, 1, epochs=1, resume=resume)
    return [b["input_ids"] for b in itertools.islice(progress.blocks_of(loader, cfg.num_workers), n)]
