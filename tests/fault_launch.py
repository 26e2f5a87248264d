"""Run by tests/test_faults.py under torchrun: train.train(job) with a fault injected into rank 1.

    torchrun --nproc_per_node=2 tests/fault_launch.py job.yaml {nan-once,nan-always,raise}

nan-once: rank 1's loss is NaN at the 2nd training step; nan-always: from the 3rd step on;
raise: rank 1 raises at the 2nd step, while rank 0 goes on into the next collective.
"""

import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

job, fault = sys.argv[1:3]
rank, calls = int(os.environ["RANK"]), [0]
run_blocks = train.run_blocks


def faulty_run_blocks(model, blocks, n_micro, filler, cfg, d, scale):
    calls[0] += 1
    if rank == 1 and fault == "raise" and calls[0] == 2:
        raise RuntimeError("injected fault on rank 1")
    loss_sum = run_blocks(model, blocks, n_micro, filler, cfg, d, scale)
    if rank == 1 and (fault == "nan-once" and calls[0] == 2 or fault == "nan-always" and calls[0] >= 3):
        # a NaN in this rank's gradients, as an overflow in its backward would leave
        next(model.parameters()).grad.fill_(float("nan"))
        loss_sum = loss_sum * float("nan")
    return loss_sum


train.run_blocks = faulty_run_blocks
train.train(yaml.safe_load(Path(job).read_text()))
