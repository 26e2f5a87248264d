"""Shared by the tests: paths, the tiny model, the CPU training job, the torchrun launcher. pyproject.toml puts
the repo root and tools/ on the import path (pytest's pythonpath); workers under torchrun get them through
PYTHONPATH."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

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
    proc = run_process(command, cwd=ROOT, env=env or worker_env(), timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def run_process(command: list, timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout); one still running at its timeout
    fails the test with where each of its processes is: every process it started (torchrun's ranks, their data
    workers) is sent SIGUSR1 (train.py prints its threads' stacks) before all are killed."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)
        for pid, command_line in tree.items():  # Python processes; not a launcher (torchrun), which SIGUSR1 would end
            argv = command_line.split()
            launcher = "torch.distributed.run" in argv[:3] or "torchrun" in [Path(a).name for a in argv[:2]]
            if argv and "python" in Path(argv[0]).name and not launcher:
                signal_if_alive(pid, signal.SIGUSR1)
                time.sleep(0.3)  # one after the other: their stacks share the pipes
        time.sleep(1)  # the last stacks are written before anything is killed
        for pid in [proc.pid, *tree]:
            signal_if_alive(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{command} still ran after {timeout} s, its stacks at the end:\n{out[-4000:]}\n{err[-30000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def descendants(root: int) -> dict[int, str]:
    """{pid: command line} of every process below root (its children, theirs, ...), whatever session each is in."""
    children, command_lines = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            parent = int(open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()[1])
            command_lines[int(entry)] = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
            children.setdefault(parent, []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found[pid] = command_lines.get(pid, "")
            todo.append(pid)
    return found


def signal_if_alive(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


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
def world_of_one(tmp_path, monkeypatch):
    """A process group of this process alone (gloo), joined as train() joins a caller's: setup_distributed's Dist,
    its host and save groups included, for the functions that take a Dist and run collectives."""
    import torch
    import torch.distributed as dist

    import train

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))  # setup's default, undone after
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    with monkeypatch.context() as setup:  # rank 0 of 1 on the CPU, on a GPU machine too (the world is gloo's)
        setup.setattr(torch.cuda, "is_available", lambda: False)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            setup.delenv(name, raising=False)
        d = train.setup_distributed(str(tmp_path))
    yield d
    dist.destroy_process_group()


def stream_blocks(cfg, tokenizer, progress, resume=None, n=None, epochs=1) -> list:
    """The input_ids of rank 0 of 1's first n blocks (all if None) through block_loader, recorded in progress."""
    import itertools

    import train

    loader = train.block_loader(cfg, tokenizer, "train", 0, 1, epochs=epochs, resume=resume)
    return [b["input_ids"] for b in itertools.islice(progress.blocks_of(loader, cfg.num_workers), n)]


def tensors(directory):
    """Every tensor of a safetensors checkpoint directory, with its stored dtype."""
    found = {}
    for f in directory.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            found.update({k: st.get_tensor(k) for k in st.keys()})
    return found


def job(tmp_path, tiny_model_dir, name, data, log_every=1, **settings):
    out = tmp_path / name
    config = write_tiny_job(
        tmp_path / f"{name}.yaml",
        tiny_model_dir,
        **({"datasets": list(data)} if isinstance(data, tuple) else {"dataset_name": str(data)}),
        pack_buffer_blocks=4,
        num_workers=2,
        gradient_accumulation_steps=2,
        param_dtype="float32",
        learning_rate=3e-3,
        warmup_steps=2,
        log_every=log_every,
        save_every=3,
        keep_checkpoints=2,
        output_dir=str(out),
        **settings,
    )
    return [*TORCHRUN, "train.py", "--config", str(config)], out


def kill_all(marker: str, sig=signal.SIGKILL) -> int:
    """Sends sig to every process whose command line holds marker (torchrun and its workers, which it starts in
    sessions of their own), as a preempted node would lose them all at once; signal 0 only counts them."""
    killed = 0
    for proc in os.listdir("/proc"):
        try:
            if proc.isdigit() and marker in open(f"/proc/{proc}/cmdline").read():
                os.kill(int(proc), sig)
                killed += 1
        except (FileNotFoundError, ProcessLookupError):
            pass
    return killed


def losses_by_step(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}  # a re-run step keeps its last record


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The run the resume tests compare with: never interrupted. log_every 2, save_every 3: a checkpoint step logs
    too, so the log window never straddles a checkpoint. Its data is a mixture: messages, and ShareGPT at weight 2."""
    tmp_path = tmp_path_factory.mktemp("straight")
    lines = open(SAMPLE).readlines()
    (tmp_path / "messages.jsonl").write_text("".join(lines[:16]))  # 52 records drawn from both: 13 steps
    roles = {"user": "human", "assistant": "gpt"}
    sharegpt = [
        [{"from": roles[m["role"]], "value": m["content"]} for m in json.loads(x)["messages"]] for x in lines[16:22]
    ]
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps({"conversations": c}) + "\n" for c in sharegpt))
    data = ({"name": str(tmp_path / "messages.jsonl")}, {"name": str(tmp_path / "sharegpt.jsonl"), "weight": 2})
    command, out = job(tmp_path, tiny_model_dir, "straight", data, log_every=2)
    assert '"by_source": {' in run_ok(command)  # the counting pass's packing statistics
    return data, out
