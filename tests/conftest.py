import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SAMPLE = ROOT / "data" / "ultrachat_sample.jsonl"


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
