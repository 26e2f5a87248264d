"""Calls train.train(config) in each rank's process, as a notebook's @distributed function does, and writes
that rank's result. Usage: torchrun --nproc_per_node=2 tests/launch_train.py job.yaml OUT_DIR"""

import json
import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

job, out = sys.argv[1:3]
result = train.train(yaml.safe_load(Path(job).read_text()))
Path(out, f"result_{os.environ['RANK']}.json").write_text(json.dumps(result))
