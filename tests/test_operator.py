"""What an operator meets: one-line errors with exit status 2, counts that survive a rank without blocks, a run
that trains nothing, a refused resume, damaged checkpoints, two runs on one output_dir."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SAMPLE, TORCHRUN, WORKERS, run, worker_env, write_tiny_job

import train

GOOD = json.loads(open(SAMPLE).readline())


def train_py(config, *flags):
    return [sys.executable, "train.py", "--config", str(config), *map(str, flags)]


def small_job(tmp_path, tiny_model_dir, name="job", **settings):
    settings = {"output_dir": str(tmp_path / "out"), "max_steps": 4, "save_every": 2, "log_every": 1, **settings}
    return write_tiny_job(tmp_path / f"{name}.yaml", tiny_model_dir, **settings)


def test_a_user_error_is_one_line_and_exit_status_2(tiny_model_dir, tmp_path):
    rc, out, err = run(train_py(small_job(tmp_path, tiny_model_dir), "--lerning_rate", "1e-4"))
    assert rc == 2 and "Traceback" not in out + err
    assert (
        err.strip()
        == "error: unknown configuration key 'lerning_rate' (from command line); did you mean 'learning_rate'?"
    )

    missing = small_job(tmp_path, tiny_model_dir, dataset_name=str(tmp_path / "nowhere.jsonl"))
    rc, out, err = run(train_py(missing))
    assert rc == 2 and err.strip() == f"error: data file {tmp_path / 'nowhere.jsonl'} does not exist"
    assert "Traceback" not in out + err

    rc, out, err = run(train_py(small_job(tmp_path, tiny_model_dir), "--float8", "true"))  # no GPU here
    assert rc == 2 and err.strip().startswith("error: float8 needs an NVIDIA GPU with float8 matmuls")

    # Each node's first rank prints it: the rendezvous may place global rank 0 on any node, and a node's log is its own
    for rank, local_rank, lines in [("8", "0", 1), ("9", "1", 0)]:
        env = {**worker_env(), "RANK": rank, "LOCAL_RANK": local_rank}
        rc, out, err = run(train_py(small_job(tmp_path, tiny_model_dir), "--lerning_rate", "1e-4"), env)
        assert rc == 2 and err.count("error: unknown configuration key 'lerning_rate'") == lines, err


def test_a_rank_that_has_finished_leaves_before_the_interpreters_teardown(tiny_model_dir, tmp_path):
    """The teardown can abort a finished rank (gloo's threads, freed with the interpreter: SIGABRT). Here an exit
    handler aborts for it: main() must leave before it runs, with the run's status, trained or stopped by an error."""
    leave = "import atexit, os, sys; atexit.register(os.abort); import train; train.main(sys.argv[1:])"
    job = small_job(tmp_path, tiny_model_dir, max_steps=2, save_every=-1)
    rc, out, err = run([sys.executable, "-c", leave, "--config", str(job)], worker_env())
    assert rc == 0 and "done: 2 steps" in out, err[-2000:]
    rc, out, err = run([sys.executable, "-c", leave, "--config", str(job), "--lerning_rate", "1e-4"], worker_env())
    assert rc == 2 and err.startswith("error: unknown configuration key 'lerning_rate'"), err[-2000:]


@pytest.mark.distributed
def test_under_torchrun_a_user_error_is_one_line_from_rank_0(tiny_model_dir, tmp_path):
    missing = small_job(tmp_path, tiny_model_dir, dataset_name=str(tmp_path / "nowhere.jsonl"))
    rc, out, err = run([*TORCHRUN, "train.py", "--config", str(missing)])
    assert rc != 0
    assert (out + err).count("does not exist") == 1 and "error: data file" in err
    assert 'File "' + str(ROOT / "train.py") not in out + err  # no traceback from the ranks


@pytest.mark.parametrize(
    "content, message",
    [(None, "No such file or directory"), ("learning_rate: [1e-5,\n", "is not valid YAML: while parsing a flow")],
)
def test_a_settings_file_that_cannot_be_read_is_one_line(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    if content is not None:
        path.write_text(content)
    for command, env, name in [
        (train_py(path), worker_env(), "--config"),
        ([sys.executable, "train.py"], worker_env(HYPERPARAMETERS_PATH=str(path)), "HYPERPARAMETERS_PATH"),
    ]:
        rc, out, err = run(command, env, timeout=60)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
        assert err.startswith(f"error: {name} {path}") and message in err


@pytest.mark.distributed
def test_a_user_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    """A check that fails on one rank only (a node-local file, a directory one rank cannot write) stops every
    rank with the same error, so rank 0 says it and no rank waits in a collective for the one that left."""
    rc, out, err = run([*TORCHRUN, str(WORKERS / "rank_error_worker.py")], timeout=120)
    assert rc == 0, err[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} raised: data file /node-local/data.jsonl does not exist (rank 1)" in out


def test_a_bug_keeps_its_traceback(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "run", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # main() turns only UserError and Interrupted into one line
        train.main(["--config", str(small_job(tmp_path, tiny_model_dir)), "--output_dir", str(tmp_path / "o")])


def test_inspect_checks_the_data_and_says_what_is_wrong_in_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out, err = run([sys.executable, "tools/inspect_data.py", "1", "--dataset_name", str(empty)], timeout=60)
    assert rc == 2 and err.strip() == f"error: dataset {empty} is empty"
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "?", "answer": "!"}\n')
    rc, out, err = run([sys.executable, "tools/inspect_data.py", "1", "--dataset_name", str(wrong)], timeout=60)
    assert rc == 2 and "has no column of a known form" in err and len(err.strip().splitlines()) == 1


def test_a_hub_model_that_cannot_be_reached_is_one_line(tmp_path):
    env = worker_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    command = [sys.executable, "tools/inspect_data.py", "1", "--dataset_name", str(SAMPLE)]
    rc, _, err = run(command, env, timeout=60)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert err.startswith("error: cannot load Qwen/Qwen3.8-27B: ")


def test_skip_counts_reach_the_totals_from_a_rank_without_blocks(tokenizer, tmp_path, capsys):
    """Rank 1 of 2 holds only an unreadable line: it makes no block, yet its count arrives with the stream's end.
    Blank lines are no records; an unreadable line is named by its number; a second epoch counts nothing again."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(GOOD) + "\n{not json\n\n\n" + json.dumps(GOOD) + "\n\n")
    cfg = train.Config(dataset_name=str(data), max_seq_len=4096, pack_buffer_blocks=1)
    rank_1 = list(train.PackedBlocks(cfg, tokenizer, "train", 1, 2, epochs=2))
    assert len(rank_1) == 1 and "input_ids" not in rank_1[0]
    assert rank_1[0]["position"].counts_at_end == {"unreadable line": 1, (0, "unreadable line"): 1}  # (source, what)
    assert f"warning: {data} line 2 is not UTF-8 JSON: skipped" in capsys.readouterr().out
    rank_0 = list(train.PackedBlocks(cfg, tokenizer, "train", 0, 2, epochs=2))
    epochs = [b["position"].epoch for b in rank_0 if "input_ids" in b]
    assert epochs.count(0) == epochs.count(1) >= 1
    counts = rank_0[-1]["position"].counts_at_end
    assert {k: v for k, v in counts.items() if isinstance(k, str)} == {"conversations": 2}  # blank lines: no records

    progress = train.Progress()
    assert list(progress.blocks_of(iter(rank_1), num_workers=0)) == []
    assert progress.stream_counts()["unreadable line"] == 1 and progress.blocks == 0
    # Resumed from its end, the stream yields its end again, with the same counts, and no block.
    again = list(train.PackedBlocks(cfg, tokenizer, "train", 1, 2, epochs=2, resume=progress))
    assert [b["position"] for b in again] == [rank_1[0]["position"]]


def test_the_counting_pass_shows_progress(tokenizer, world_of_one, monkeypatch, capsys):
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=2048, num_workers=0, pack_buffer_blocks=2)
    monkeypatch.setattr(train.CountedBlocks, "progress_every_s", -1)  # a line per block
    counting = train.block_loader(cfg, tokenizer, "train", 0, 1, 1, counting=True)
    blocks, _ = train.count_blocks(iter(counting), cfg, world_of_one)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("counting: ")]
    assert len(lines) == blocks and lines[-1].startswith(f"counting: {blocks:,} blocks so far, rank 0 stream 0")


def test_the_counting_pass_counts_in_its_worker_while_the_process_does_other_work(
    tokenizer, world_of_one, monkeypatch, tmp_path
):
    """Nothing is taken from the counting loader until count_blocks: its worker must still reach the last block (a
    stream that handed over blocks would stop after the loader's prefetch of 4), and count what num_workers 0 does."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=512, num_workers=0, pack_buffer_blocks=2)
    counting = iter(train.block_loader(cfg, tokenizer, "train", 0, 1, 1, counting=True))
    expected, in_process = train.count_blocks(counting, cfg, world_of_one)
    assert expected > 8
    log = tmp_path / "printed.txt"  # what print0 says, in the forked worker too (appended: no lost line)

    def to_log(rank, *args, file=None):
        with open(log, "a") as f:
            print(*args, file=f)

    monkeypatch.setattr(train, "print0", to_log)
    monkeypatch.setattr(train.CountedBlocks, "progress_every_s", -1)  # a line per block
    cfg = dataclasses.replace(cfg, num_workers=1)
    counting = iter(train.block_loader(cfg, tokenizer, "train", 0, 1, 1, counting=True))
    deadline = time.monotonic() + 60
    last = f"counting: {expected:,} blocks so far, rank 0 stream 0"
    while not (log.exists() and last in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert last in log.read_text(), log.read_text()[-300:]
    assert train.count_blocks(counting, cfg, world_of_one) == (expected, in_process)
    waited = re.search(r"waited ([0-9.]+)s\)", log.read_text())
    assert float(waited[1]) < 5  # the count was done: count_blocks took the stream's end alone


def test_a_ranks_data_workers_die_with_it(tiny_model_dir, tmp_path):
    """A data worker holds its rank's sockets, so the peers of a rank that died learn it only when those close. Left
    alone, a counting worker counts on (it hands nothing over, so it never meets the DataLoader's check on its
    parent), and a training worker waits for that check, every 5 s. Both must be gone at once."""
    data = tmp_path / "long.jsonl"
    data.write_text(SAMPLE.read_text() * 100)  # minutes to count here
    rank = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
import train
cfg = train.Config(model_name={str(tiny_model_dir)!r}, model_revision="", dataset_name={str(data)!r}, max_seq_len=512)
tokenizer = train.load_tokenizer(cfg)
counting = iter(train.block_loader(cfg, tokenizer, "train", 0, 1, 1, counting=True))
blocks = iter(train.block_loader(cfg, tokenizer, "train", 0, 1, 1))
next(blocks)
print(counting._workers[0].pid, blocks._workers[0].pid, flush=True)
os._exit(1)  # as a rank that dies
"""
    with open(tmp_path / "rank.out", "w") as out:  # not a pipe: the workers would hold it open
        subprocess.run([sys.executable, "-c", rank], stdout=out, timeout=120)
    workers = [int(pid) for pid in (tmp_path / "rank.out").read_text().split()]

    def alive(pid: int) -> bool:  # a zombie (no one reaps an orphan in some containers) has stopped
        try:
            return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 1.5
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not any(map(alive, workers)), "a data worker outlives its rank (counting, training)"
    finally:  # a worker that counts on would take a core from the rest of the suite for minutes
        for pid in filter(alive, workers):  # a dead one's pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_run_that_trains_no_step_fails_and_exports_nothing(tiny_model_dir, tmp_path):
    """max_steps skips the counting pass; 16-token blocks truncate every conversation to its prompt."""
    rc, out, err = run(train_py(small_job(tmp_path, tiny_model_dir, max_seq_len=16, max_steps=2)))
    assert rc == 2 and "error: no step was trained: the data holds nothing to learn from" in err, err[-2000:]
    assert "'no loss tokens after truncation': " in err and not (tmp_path / "out/checkpoints").exists()
    assert not (tmp_path / "out/model").exists()


def test_a_refused_resume_names_old_and_new_values_and_keeps_config_yaml(tiny_model_dir, tmp_path):
    job = small_job(tmp_path, tiny_model_dir, max_steps=2, export=False, learning_rate=1e-3)
    assert run(train_py(job))[0] == 0
    logged = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in logged if "lr" in r]  # the lr each step used: warmup from 1/11 of the peak (10 steps)
    assert lrs == [pytest.approx(1e-3 / 11), pytest.approx(2e-3 / 11)]
    rc, out, err = run(train_py(job, "--max_steps", "4", "--learning_rate", "2e-3", "--seed", "7"))
    assert rc == 2 and "(learning_rate: 0.001 -> 0.002, seed: 0 -> 7)" in err, err[-2000:]
    saved = train.load_config(train.yaml_source(tmp_path / "out/config.yaml", "saved"))
    assert saved.learning_rate == 1e-3 and saved.seed == 0 and saved.max_steps == 2


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, tmp_path_factory):
    """A finished one-process run with complete checkpoints at steps 2 and 4."""
    tmp_path = tmp_path_factory.mktemp("two")
    job = small_job(tmp_path, tiny_model_dir, export=False, param_dtype="float32")
    rc, out, err = run(train_py(job))
    assert rc == 0, err[-3000:]
    return job, tmp_path / "out"


def test_a_finished_run_started_again_trains_nothing_and_says_so(two_checkpoints, tmp_path):
    job, finished = two_checkpoints
    shutil.copytree(finished, tmp_path / "out")
    rc, out, err = run(train_py(job, "--output_dir", tmp_path / "out"))
    assert rc == 0 and f"resumed from {tmp_path}/out/checkpoints/step_00000004 (step 4 of 4)" in out, err[-3000:]
    assert "done: 4 steps, none in this run, data seen " in out


def test_a_checkpoint_of_a_train_py_that_packed_each_buffer_alone_is_refused(two_checkpoints, tmp_path):
    """Its data positions count blocks of buffers packed without the carry: resumed now, they would name others."""
    import torch

    job, finished = two_checkpoints
    shutil.copytree(finished, tmp_path / "out")
    for step in (tmp_path / "out/checkpoints").glob("step_*"):  # as the earlier train.py wrote them, hashes too
        state = torch.load(step / "rank_00000.pt", weights_only=False)
        for position in state["progress"]["streams"].values():
            del position["carried"]
        torch.save(state, step / "rank_00000.pt")
        meta = json.loads((step / "complete.json").read_text())
        meta["files"]["rank_00000.pt"] = (step / "rank_00000.pt").stat().st_size
        meta["sha256"]["rank_00000.pt"] = train.sha256(step / "rank_00000.pt")
        (step / "complete.json").write_text(json.dumps(meta))
    rc, out, err = run(train_py(job, "--output_dir", tmp_path / "out"))
    assert rc == 2 and "was written by a train.py that packed differently: resume it with that version" in err, err


def damage(step: str, how: str) -> None:
    if how == "empty complete.json":
        (step / "complete.json").write_text("")
    elif how == "truncated .metadata":
        data = (step / ".metadata").read_bytes()
        (step / ".metadata").write_bytes(data[: len(data) // 2])
    elif how == "truncated shard":
        shard = max(step.glob("*.distcp"), key=lambda f: f.stat().st_size)
        os.truncate(shard, shard.stat().st_size - 1)
    elif how == "changed rank file":
        data = bytearray((step / "rank_00000.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
        (step / "rank_00000.pt").write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, problem",
    [
        ("empty complete.json", "JSONDecodeError: "),
        ("truncated .metadata", ".metadata has "),
        ("truncated shard", ".distcp has "),
        ("changed rank file", "rank_00000.pt differs from what was written"),
    ],
)
def test_each_kind_of_damage_is_found_by_the_cheap_check(two_checkpoints, tmp_path, how, problem):
    _, finished = two_checkpoints
    step = tmp_path / "step_00000004"
    shutil.copytree(finished / "checkpoints/step_00000004", step)
    assert train.checkpoint_problem(step) is None
    damage(step, how)
    assert problem in train.checkpoint_problem(step)


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(two_checkpoints, tmp_path):
    job, finished = two_checkpoints
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    damage(out / "checkpoints/step_00000004", "truncated shard")
    rc, stdout, err = run(train_py(job, "--output_dir", out, "--max_steps", "5"))
    assert rc == 0, err[-3000:]
    assert f"warning: checkpoint {out}/checkpoints/step_00000004 is damaged (" in stdout
    assert f"resumed from {out}/checkpoints/step_00000002 (step 2 of 4)" in stdout
    assert (
        len(list((out / "checkpoints").glob("rejected-step_00000004-*"))) == 1
    )  # kept for a look, never resumed from again
    assert [p.name for p in train.complete_checkpoints(train.Config(output_dir=str(out)))][-1] == "step_00000005"


def test_a_checkpoint_without_its_file_records_is_damaged_and_all_damaged_ones_stop_the_run(
    two_checkpoints, tmp_path, world_of_one
):
    _, finished = two_checkpoints
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    old = out / "checkpoints/step_00000004"
    meta = json.loads((old / "complete.json").read_text())
    (old / "complete.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("files", "sha256")}))
    assert train.checkpoint_problem(old) == "KeyError: 'files'"  # nothing to check it against: never trusted
    (out / "checkpoints/step_00000002/complete.json").write_text("")
    with pytest.raises(train.UserError, match="every checkpoint in .* is damaged"):
        train.resume_point(train.Config(output_dir=str(out)), world_of_one)
    assert len(list((out / "checkpoints").glob("rejected-step_*"))) == 2 and not train.complete_checkpoints(
        train.Config(output_dir=str(out))
    )


def test_complete_json_lists_every_file_and_hashes_the_small_ones(two_checkpoints):
    _, out = two_checkpoints
    step = out / "checkpoints/step_00000004"
    meta = json.loads((step / "complete.json").read_text())
    assert set(meta["files"]) == {p.name for p in step.iterdir()} - {"complete.json"}
    assert {".metadata", "rank_00000.pt"} <= set(meta["sha256"])


def lock_file(out, host, pid, age_s=0.0):
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.lock").write_text(json.dumps({"host": host, "pid": pid, "started": "2026-11-30 00:00:00"}))
    os.utime(out / "run.lock", (time.time() - age_s, time.time() - age_s))


@pytest.mark.parametrize("launcher", ["python", "torchrun's first attempt"])
def test_a_second_run_on_one_output_dir_refuses_naming_the_holder(tiny_model_dir, tmp_path, launcher):
    """Under torchrun the refused run leaves the live run's user_error.json as it was: neither written (the live
    run's restarts would stop on it) nor removed (a new run's first attempt removes an old run's, under the lock)."""
    lock_file(tmp_path / "out", socket.gethostname(), os.getpid())  # held by this live process
    (tmp_path / "out/user_error.json").write_text(live := json.dumps([1, "the live run's"]))
    env = worker_env(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="2") if launcher != "python" else None
    rc, out, err = run(train_py(small_job(tmp_path, tiny_model_dir)), env)
    assert rc == 2 and f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()}" in err, err
    assert not (tmp_path / "out/metrics.jsonl").exists()
    assert (tmp_path / "out/user_error.json").read_text() == live


@pytest.mark.parametrize(
    "holder, age_s, taken",
    [
        ("dead pid here", 0, True),
        ("our own pid here: a restarted container", 0, True),
        ("other host, fresh", 0, False),
        ("other host, silent 3 min", 180, True),
    ],
)
def test_a_dead_holders_lock_is_taken_over(tmp_path, world_of_one, holder, age_s, taken):
    dead = subprocess.Popen(["true"])
    dead.wait()
    host, pid = {"dead pid here": (socket.gethostname(), dead.pid)}.get(holder, ("elsewhere", 1))
    if holder.startswith("our own pid"):
        host, pid = socket.gethostname(), os.getpid()
    lock_file(tmp_path / "out", host, pid, age_s)
    if not taken:
        with pytest.raises(train.UserError, match="is in use by another run \\(host elsewhere, pid 1"):
            train.RunLock(tmp_path / "out", world_of_one)
        return
    with train.RunLock(tmp_path / "out", world_of_one):
        assert json.loads((tmp_path / "out/run.lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "out/run.lock").exists()  # released at the end


def test_of_two_runs_taking_the_lock_at_once_the_one_whose_write_was_replaced_refuses(
    tmp_path, world_of_one, monkeypatch
):
    """acquire() reads the lock back after its write: another run's write in between (here during its 0.2 s wait)
    wins, and this run stops."""
    (tmp_path / "out").mkdir()
    other = {"host": "elsewhere", "pid": 1, "started": "2026-12-05 00:00:00", "run": "0123456789abcdef"}
    monkeypatch.setattr(train.time, "sleep", lambda s: (tmp_path / "out/run.lock").write_text(json.dumps(other)))
    with pytest.raises(train.UserError, match="was just taken"):
        train.RunLock(tmp_path / "out", world_of_one)


class Wakes:  # RunLock.refresh's wait, without its 30 s: it returns at once, once; then the loop ends
    def __init__(self):
        self.calls = 0

    def wait(self, timeout):
        self.calls += 1
        return self.calls > 1

    def is_set(self):
        return False


def test_a_run_whose_lock_was_taken_over_exits_at_its_next_refresh(tmp_path, world_of_one, monkeypatch, capsys):
    """A run frozen past the lock's 2 minutes (a suspended host) may find, once it wakes, that another run has taken
    its output_dir over: its next refresh ends the process before it writes a checkpoint beside that run's. Its own
    lock it only refreshes."""
    (tmp_path / "out").mkdir()
    lock, path = train.RunLock(tmp_path / "out", world_of_one), tmp_path / "out/run.lock"
    refresh_thread_event, exits = lock.released, []
    os.utime(path, (time.time() - 60, time.time() - 60))
    lock.released = Wakes()
    lock.refresh()
    assert time.time() - path.stat().st_mtime < 30 and json.loads(path.read_text()) == lock.me
    other = {"host": "elsewhere", "pid": 1, "started": "2026-12-04 00:00:00", "run": "0123456789abcdef"}
    path.write_text(json.dumps(other))  # as acquire() writes it, in the run that took over
    monkeypatch.setattr(os, "_exit", exits.append)  # the real one would end pytest
    lock.released = Wakes()
    lock.refresh()
    assert exits == [2] and f"error: another run took over {path}" in capsys.readouterr().err
    lock.released = refresh_thread_event
    lock.__exit__(None, None, None)
    assert json.loads(path.read_text()) == other  # left to the run that holds it
