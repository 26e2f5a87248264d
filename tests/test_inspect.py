"""tools/inspect_data.py: the packed blocks, readable and as JSON lines, from a directory with only a tokenizer."""

import json
import shutil
import subprocess
import sys

import torch
from conftest import ROOT, SAMPLE


def test_inspect_needs_only_the_tokenizer_and_writes_the_block_signals(tiny_model_dir, tmp_path):
    tok_dir = tmp_path / "tokenizer-only"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, tok_dir / name)
    out = tmp_path / "blocks.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/inspect_data.py",
            "2",
            "--out",
            str(out),
            "--model_name",
            str(tok_dir),
            "--model_revision",
            "",
            "--dataset_name",
            str(SAMPLE),
            "--max_seq_len",
            "2048",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("=== block ") == 2 and "⟦" in proc.stdout and "<|im_end|>⟧" in proc.stdout
    assert "non-padding" in proc.stdout and "loss tokens" in proc.stdout
    blocks = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(blocks) == 2
    for b in blocks:
        assert set(b) == {"input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx"}
        assert len(b["input_ids"][0]) == len(b["labels"][0]) == len(b["position_ids"][0]) == 2048
        cu = torch.tensor(b["cu_seqlens"])
        assert torch.equal(torch.tensor(b["seq_idx"][0]), torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()))
