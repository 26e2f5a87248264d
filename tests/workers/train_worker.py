"""Calls train.train(config) in each rank's process, as a notebook's @distributed function does, and writes
that rank's result. Usage: torchrun --nproc_per_node=2 tests/workers/train_worker.py job.yaml OUT_DIR"""

import json
import os
import sys
from pathlib import Path

import yaml

import train

job, out = sys.argv[1:3]
result = train.train(yaml.safe_load(Path(job).read_text()))
Path(out, f"result_{os.environ['RANK']}.json").write_text(json.dumps(result))
