"""Calls train.train(config) in each rank's process, as a notebook's @distributed function does, and writes that
rank's result and what reached its loss: per step hook call, every trained segment's tokens (a segment with a loss
token: not padding, not a filler) with its epoch. Usage: torchrun --nproc_per_node=2 tests/workers/train_worker.py
job.yaml OUT_DIR"""

import json
import os
import sys
from pathlib import Path

import yaml
from clean_exit import leave

import train

job, out = sys.argv[1:3]
steps, trained = [], []


def record(step, model, loss_sum, blocks):
    steps.append(step)
    for block in blocks:  # this rank's blocks of the step; a filler has no stream position
        bounds = block["cu_seqlens"].tolist()
        for a, b in zip(bounds, bounds[1:]):
            if "position" in block and (block["labels"][0, a:b] != -100).any():
                trained.append([block["position"].epoch, block["input_ids"][0, a:b].tolist()])


result = train.train(yaml.safe_load(Path(job).read_text()), step_hook=record)
Path(out, f"result_{os.environ['RANK']}.json").write_text(json.dumps(result))
Path(out, f"trained_{os.environ['RANK']}.json").write_text(json.dumps({"steps": steps, "segments": trained}))
leave()  # clean_exit.py: as train.py's main() leaves
