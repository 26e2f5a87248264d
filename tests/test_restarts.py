"""Restarts inside the job on 2 CPU ranks under torchrun: a hung, killed or failing rank, a user error, slow saves
and exports, a killed launcher; SIGTERM while a fault unwinds, and under plain `python train.py`."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import (
    ROOT,
    TORCHRUN,
    WORKERS,
    descendants,
    job,
    kill_all,
    losses_by_step,
    run_ok,
    run_process,
    tensors,
    worker_env,
    write_tiny_job,
)

import train


def test_the_launchers_sigterm_after_a_fault_does_not_cut_the_ranks_report_short():
    """A rank whose peer died fails in its next collective, and torchrun sends it SIGTERM at about the same time: the
    SIGTERM must not end the process before train() has said what failed and what comes next. A clean end of
    training gives SIGTERM back its default action."""
    rank = f"""
import os, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
import train
with train.stop_on_sigterm():
    pass
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
try:
    with train.stop_on_sigterm():
        raise RuntimeError("the peer is gone")
except RuntimeError:
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, while the fault unwinds
    time.sleep(0.2)
    print("reported", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "reported\n", (proc.returncode, proc.stderr[-2000:])


def test_a_plain_python_run_prints_its_stacks_on_sigusr1_and_on_sigterm_saves_and_exits_128_plus_sigterm(
    tiny_model_dir, tmp_path
):
    """`python train.py` without torchrun (a world of one) handles SIGTERM as the ranks do: it finishes the step,
    saves, says so in one line and exits with the status of a process killed by SIGTERM. Before that, SIGUSR1 to
    it and its data worker has each print its threads' stacks, and training goes on."""
    config = write_tiny_job(
        tmp_path / "job.yaml", tiny_model_dir, max_steps=500, log_every=1, save_every=1000, num_workers=1
    )
    command = [sys.executable, "train.py", "--config", str(config), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = threading.Timer(180, proc.kill)  # a stop that hangs fails the test instead of stalling the suite
    deadline.start()
    try:
        lines, steps, worker = [], 0, None
        for line in proc.stdout:  # the first step's log line: training has started
            lines.append(line)
            steps += line.startswith("step ")
            if steps == 1 and line.startswith("step "):
                worker = list(descendants(proc.pid))
                for pid in [proc.pid, *worker]:  # one after the other: their stacks share the pipe
                    os.kill(pid, signal.SIGUSR1)
                    time.sleep(1)
            elif steps == 2:  # a step after the stacks: SIGUSR1 did not end it
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        status = proc.wait(timeout=60)
    finally:
        deadline.cancel()
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert len(worker) == 1, worker  # the data worker
    # every thread of each: the rank's run-lock thread (its main thread may be deeper than the 100 frames shown),
    # and the worker's loop
    assert "in refresh" in output and "in _worker_loop" in output, output[-3000:]
    assert status == 128 + signal.SIGTERM, output[-3000:]
    stopped = re.search(r"^stopped by SIGTERM after step (\d+); the newest checkpoint is .*step_", lines[-1])
    assert stopped, output[-3000:]
    assert (tmp_path / f"out/checkpoints/step_{int(stopped[1]):08d}/complete.json").exists()


def restarting(config, fault, restarts=1):
    """fault_worker.py under torchrun with --max-restarts: (exit status, stdout and stderr)."""
    command = [*TORCHRUN, f"--max-restarts={restarts}", str(WORKERS / "fault_worker.py"), str(config), fault]
    proc = run_process(command, cwd=ROOT, env=worker_env(), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["stop-rank1-once-at-5", "stop-rank1-once-before-5", "kill-rank1-once-at-5"])
def test_a_hung_or_killed_rank_restarts_inside_the_job_and_the_run_ends_bit_identical(
    fault, tiny_model_dir, straight, tmp_path
):
    """Rank 1 hangs (SIGSTOP) in step 5 or just before it (rank 0 then waits in a collective of the host's numbers,
    on their gloo group), or dies (SIGKILL) in step 5: the job notices (rank 0's collective times out after
    collective_timeout_s, naming rank 1 as silent first; or it loses its peer), torchrun restarts both workers,
    and they resume from step 3's checkpoint to the uninterrupted run's losses and weights. Saves are written in the
    foreground: on a loaded machine (CI) step 3's background write can outlast step 4, and is then incomplete when
    step 5 fails (tests/test_checkpoint.py kills runs with background writes in flight)."""
    data, straight = straight
    settings = dict(log_every=2, collective_timeout_s=20, async_save=False)
    _, out = job(tmp_path, tiny_model_dir, "restarted", data, **settings)
    started = time.monotonic()
    status, output = restarting(tmp_path / "restarted.yaml", fault)
    assert status == 0, output[-4000:]
    assert "attempt 1 of 2 failed: torchrun restarts the workers, which resume" in output
    assert f"resumed from {out}/checkpoints/step_00000003" in output
    if fault.startswith("stop"):
        assert re.search(
            r"rank 0: no step has ended for \d+ s \(next: step 5\); silent ranks: rank 1 \(\d+ s\); "
            r"a training collective times out at 20 s",
            output,
        ), output[-4000:]
        assert "Timed out waiting 20000ms" in output and time.monotonic() - started < 150
    assert losses_by_step(out) == losses_by_step(straight)
    a, b = tensors(straight / "model"), tensors(out / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_a_rank_that_keeps_failing_stops_the_job_after_its_restarts_with_the_checkpoint_intact(
    tiny_model_dir, straight, tmp_path
):
    data, straight = straight  # step 3's checkpoint complete before step 5 fails, as above
    command, out = job(tmp_path, tiny_model_dir, "failing", data, log_every=2, async_save=False)
    status, output = restarting(tmp_path / "failing.yaml", "kill-rank1-at-5")
    assert status != 0 and output.count(f"resumed from {out}/checkpoints/step_00000003") == 1, output[-4000:]
    last = f"the last of 2 attempts failed: the job stops; its newest checkpoint is {out}/checkpoints/step_00000003"
    assert output.count(last) == 1 and output.count("attempt 1 of 2 failed") == 1, output[-4000:]
    newest = train.complete_checkpoints(train.Config(output_dir=str(out)))
    assert [p.name for p in newest] == ["step_00000003"] and train.checkpoint_problem(newest[0]) is None
    run_ok(command)  # and it resumes: the rest of the run is the uninterrupted one
    assert losses_by_step(out) == losses_by_step(straight)


@pytest.mark.distributed
def test_a_restart_after_a_user_error_stops_at_once_with_it(tiny_model_dir, tmp_path):
    """torchrun restarts on any failure: a run that diverged (a UserError) is not loaded and diverged again."""
    config = write_tiny_job(
        tmp_path / "diverging.yaml", tiny_model_dir, max_steps=12, save_every=3, output_dir=str(tmp_path / "out")
    )
    status, output = restarting(config, "nan-always", restarts=2)
    again = "steps in a row with a non-finite loss or gradient norm at step 7: stopping."
    assert status != 0 and again in output and "(the attempt before this restart stopped on it)" in output, output
    assert "resumed from" not in output  # the restarts loaded nothing: they would have resumed from step 6
    assert "stopped on it) (rank 0) (" not in output  # the third attempt says it as the second did


@pytest.mark.distributed
def test_waits_longer_than_the_collective_timeout_in_step_1_saves_and_the_export_do_not_end_the_run(
    tiny_model_dir, tmp_path
):
    """Rank 1's first step (a compile) and checkpoint writes (a slow volume), and rank 0's end of the export, each
    take 1.5 timeouts: the short timeout starts after the first step, saves wait on their own group, and the end of
    training has the startup's timeout again."""
    config = write_tiny_job(
        tmp_path / "slow.yaml",
        tiny_model_dir,
        max_steps=3,
        save_every=2,
        async_save=False,  # a synchronous save's collectives run in the training thread (async ones in DCP's own)
        collective_timeout_s=4,
        output_dir=str(tmp_path / "slow"),
    )
    status, output = restarting(config, "slow-waits", restarts=0)
    assert status == 0 and "step 3/3" in output and (tmp_path / "slow/model/config.json").exists(), output[-4000:]
    assert output.count("checkpoint step ") == 2  # step 2's, then the end's


@pytest.mark.distributed
@pytest.mark.parametrize("output", ["read", "closed"])
def test_workers_exit_when_their_launcher_is_killed(tiny_model_dir, tmp_path, output):
    """closed: the pipe of their output is closed with the launcher (its reader gone too), and training says nothing
    for minutes (log_every): a worker still exits, though it cannot say why."""
    quiet = dict(log_every=1000) if output == "closed" else {}
    config = write_tiny_job(
        tmp_path / "orphans.yaml", tiny_model_dir, max_steps=400, save_every=-1, export=False, **quiet
    )
    faulty = [*TORCHRUN, str(WORKERS / "fault_worker.py"), str(config), "kill-launcher-at-2"]
    launcher = subprocess.Popen(faulty, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    launcher.wait(timeout=120)
    killed_at = time.time()
    if output == "closed":
        launcher.stdout.close()
    while kill_all(str(config), 0) and time.time() < killed_at + 30:  # signal 0: are they there?
        time.sleep(0.2)
    gone_after = time.time() - killed_at
    kill_all(str(config), signal.SIGKILL)  # none left behind, whatever the test finds
    said = launcher.stdout.read().decode() if output == "read" else ""
    assert launcher.returncode == -signal.SIGKILL and gone_after < 5, said[-2000:]
    # A rank sees it and exits; the other sees it too, or first loses its peer in a collective: both stop.
    assert output == "closed" or "the launcher (pid " in said and "step 400/" not in said


def test_a_command_still_running_at_its_timeout_fails_with_the_stacks_of_every_process_it_started():
    """The tests' run_process: each process below the command (a forked one too) prints its stacks on SIGUSR1, as
    train.py's ranks and data workers do; then all are killed, and the failure shows the stacks."""
    sleeper = "import faulthandler, os, signal, time\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
    sleeper += "os.fork()\ntime.sleep(300)"  # the forked child inherits the handler, as a DataLoader worker does
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still ran after 5 s") as failure:
        run_process(["bash", "-c", f"{sys.executable} -c '{sleeper}'; true"], timeout=5)
    assert failure.value.msg.count('File "<string>", line 4 in <module>') == 2, failure.value.msg  # parent, child
    assert time.monotonic() - started < 30 and not kill_all(sleeper.splitlines()[-1], 0)  # none left behind
