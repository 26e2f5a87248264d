"""Run by tests/test_operator.py under torchrun: a UserError raised on rank 1 alone reaches every rank.

torchrun --nproc_per_node=2 tests/workers/rank_error_worker.py
"""

from clean_exit import leave

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
leave()  # clean_exit.py: as train.py's main() leaves
