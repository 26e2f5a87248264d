"""Run by tests/test_faults.py and tests/test_checkpoint.py under torchrun: train.train(job) with a fault.

    torchrun --nproc_per_node=2 tests/workers/fault_worker.py job.yaml FAULT

FAULT: nan-once, nan-always, raise, kill-at-N, sigterm-launcher-at-N or kill-launcher-at-N.

nan-once: rank 1's loss is NaN at the 2nd training step; nan-always: from the 3rd step on;
raise: rank 1 raises at the 2nd step, while rank 0 goes on into the next collective;
kill-at-N: every rank SIGKILLs itself in step N's hook (after its backward, before the step's end), as a
preempted node would die, with whatever checkpoint write was in flight;
sigterm-launcher-at-N: rank 0 sends SIGTERM to torchrun in step N, as a scheduler stopping the job would;
kill-launcher-at-N: rank 0 SIGKILLs torchrun alone in step N; the steps after it take 0.5 s each;
stop-rankR-once-at-N, kill-rankR-once-at-N: rank R SIGSTOPs (hangs) or SIGKILLs itself in step N of the first
attempt only (a file beside job.yaml remembers it), as a hung or crashed rank would (the stopped one is SIGKILLed
once torchrun's SIGTERM is pending); stop-rankR-once-before-N: the same between steps N - 1 and N, where the
others wait in the host's collectives (a stalled read would stop a rank there); kill-rankR-at-N: in every attempt;
slow-waits: rank 1's first step and checkpoint writes, and rank 0's end of the export, each take 1.5
collective_timeout_s longer (a first step's compile, a slow volume).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from clean_exit import leave
from torch.distributed.checkpoint import FileSystemWriter

import train

job, fault = sys.argv[1:3]
rank = int(os.environ["RANK"])
once = Path(job).with_suffix(".fault-done")


def inject(step, model, loss_sum, blocks):
    """train()'s step hook: runs after each step's backward, before clipping."""
    if fault == f"kill-at-{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and fault in (f"sigterm-launcher-at-{step}", f"kill-launcher-at-{step}"):
        os.kill(os.getppid(), signal.SIGTERM if fault.startswith("sigterm") else signal.SIGKILL)
    if fault.startswith("kill-launcher-at-") and step > int(fault.rsplit("-", 1)[1]):
        time.sleep(0.5)
    if fault in (f"stop-rank{rank}-once-at-{step}", f"kill-rank{rank}-once-at-{step}"):
        halt_once()
    if fault == f"kill-rank{rank}-at-{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and fault == "slow-waits" and step == 1:
        time.sleep(1.5 * settings["collective_timeout_s"])
    if rank == 1 and fault == "raise" and step == 2:
        raise RuntimeError("injected fault on rank 1")
    if rank == 1 and (fault == "nan-once" and step == 2 or fault == "nan-always" and step >= 3):
        # a NaN in this rank's gradients, as an overflow in its backward would leave
        next(model.parameters()).grad.fill_(float("nan"))
        loss_sum = loss_sum * float("nan")
    return loss_sum


def halt_once():  # the first attempt's rank stops (SIGSTOP) or dies (SIGKILL); a restart's goes on
    if once.exists():
        return
    once.write_text(fault)
    if fault.startswith("stop"):  # torchrun's restart then waits a fixed 30 s before its SIGKILL: sooner here
        subprocess.Popen([sys.executable, "-c", KILL_ONCE_TERMINATED, str(os.getpid())], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP if fault.startswith("stop") else signal.SIGKILL)


def halting_before(train_step):  # stop-rankR-once-before-N: train_step's start, after the loop's SIGTERM check
    def step(job, blocks, data_wait_s=0.0):
        if fault == f"stop-rank{rank}-once-before-{job.progress.step + 1}":
            halt_once()
        return train_step(job, blocks, data_wait_s)

    return step


# A stopped process keeps torchrun's SIGTERM pending (/proc/PID/status); this SIGKILLs it as soon as one is.
KILL_ONCE_TERMINATED = """
import os, signal, sys, time
pid, term = int(sys.argv[1]), 1 << (signal.SIGTERM - 1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM is for the worker
try:
    while not any(int(line.split()[1], 16) & term for line in open(f"/proc/{pid}/status") if "Pnd:" in line):
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
except (FileNotFoundError, ProcessLookupError):
    pass  # gone already
"""


def slowly(function, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)

    return slow


settings = yaml.safe_load(Path(job).read_text())
train.train_step = halting_before(train.train_step)
if fault == "slow-waits":  # legitimate waits longer than the collective timeout
    late = 1.5 * settings["collective_timeout_s"]
    if rank == 1:  # in the background write (async_save) or the save itself
        FileSystemWriter.write_data = slowly(FileSystemWriter.write_data, late)
    if rank == 0:  # the export's files, written by rank 0 while the others wait
        train.stop_at_end_of_turn = slowly(train.stop_at_end_of_turn, late)
train.train(settings, step_hook=inject)
leave()  # clean_exit.py: as train.py's main() leaves
