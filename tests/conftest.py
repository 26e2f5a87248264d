import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SAMPLE = ROOT / "data" / "ultrachat_sample.jsonl"


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
