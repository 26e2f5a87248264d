"""Run by tests/test_faults.py and tests/test_checkpoint.py under torchrun: train.train(job) with a fault.

    torchrun --nproc_per_node=2 tests/workers/fault_worker.py job.yaml FAULT

FAULT: nan-once, nan-always, raise, kill-at-N, sigterm-launcher-at-N or kill-launcher-at-N.

nan-once: rank 1's loss is NaN at the 2nd training step; nan-always: from the 3rd step on;
raise: rank 1 raises at the 2nd step, while rank 0 goes on into the next collective;
kill-at-N: every rank SIGKILLs itself in step N's hook (after its backward, before the step's end), as a
preempted node would die, with whatever checkpoint write was in flight;
sigterm-launcher-at-N: rank 0 sends SIGTERM to torchrun in step N, as a scheduler stopping the job would;
kill-launcher-at-N: rank 0 SIGKILLs torchrun alone in step N; the steps after it take 0.5 s each.
"""

import os
import signal
import sys
import time
from pathlib import Path

import yaml

import train

job, fault = sys.argv[1:3]
rank = int(os.environ["RANK"])


def inject(step, model, loss_sum, blocks):
    """train()'s step hook: runs after each step's backward, before clipping."""
    if fault == f"kill-at-{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and fault in (f"sigterm-launcher-at-{step}", f"kill-launcher-at-{step}"):
        os.kill(os.getppid(), signal.SIGTERM if fault.startswith("sigterm") else signal.SIGKILL)
    if fault.startswith("kill-launcher-at-") and step > int(fault.rsplit("-", 1)[1]):
        time.sleep(0.5)
    if rank == 1 and fault == "raise" and step == 2:
        raise RuntimeError("injected fault on rank 1")
    if rank == 1 and (fault == "nan-once" and step == 2 or fault == "nan-always" and step >= 3):
        # a NaN in this rank's gradients, as an overflow in its backward would leave
        next(model.parameters()).grad.fill_(float("nan"))
        loss_sum = loss_sum * float("nan")
    return loss_sum


train.train(yaml.safe_load(Path(job).read_text()), step_hook=inject)
