"""Run by tests/test_operator.py under torchrun: a UserError raised on rank 1 alone reaches every rank.

torchrun --nproc_per_node=2 tests/workers/rank_error_worker.py
"""

import os
import sys

import train

d = train.setup_distributed()


def check():
    if d.rank == 1:
        raise train.UserError("data file /node-local/data.jsonl does not exist")
    return "ok"


try:
    train.on_every_rank(check, d)
except train.UserError as e:
    print(f"rank {d.rank} raised: {e}", flush=True)
# As train.py's main(): no interpreter teardown, in which gloo's threads can abort a finished rank (SIGABRT)
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
