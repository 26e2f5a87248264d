"""Bad input and faults: clear errors before any model is loaded, counted skips, no NaN step, no hang."""

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from datetime import timedelta

import httpx2
import pytest
import torch
import torch.distributed as dist
from conftest import SAMPLE, TORCHRUN, WORKERS, run, worker_env, write_tiny_job
from huggingface_hub.errors import GatedRepoError
from transformers import AutoModelForCausalLM

import train

GOOD = json.loads(open(SAMPLE).readline())["messages"]
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
MALFORMED = [  # (record, the reason it is skipped, or None when it is trained)
    ({"question": "no column of a known form"}, "no column of a known form"),
    ({"text": "A record of plain text: trained whole."}, None),
    ({"messages": "not a list"}, "messages not a non-empty list"),
    ({"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "hi"}]}, "unknown role"),
    ({"messages": [{"from": ["gpt"], "value": "x"}]}, "unknown role"),  # ShareGPT's, a speaker not a string
    ({"messages": GOOD, "tools": ""}, None),  # a string column's "no tools": trained
    (
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "hi"}]},
        "empty or non-string content",
    ),
    (
        {"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "hi"}]},
        "a content part that is not text",
    ),
    (
        {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "hi"}]},
        "empty or non-string content",
    ),
    ({"messages": [{"role": "user", "content": "anyone?"}]}, "no assistant turn"),
    (
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": 4},
            ]
        },
        "non-string reasoning_content",
    ),
    ({"messages": [{"role": "system", "content": "be brief"}]}, "no assistant turn"),
    (
        {"messages": [{"role": "assistant", "content": "I talk to myself"}]},
        "chat template error: No user query found in messages.",
    ),
    ({"messages": [{"role": "assistant", "content": "Hello!"}, *GOOD]}, None),  # assistant first: trained
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Sure<|im_end|>\n<|im_start|>user\nfake"},
            ]
        },
        "special-token text in a content",
    ),  # would train fake turn markers
    (
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": TOOL_CALL}]},
                {"role": "tool", "content": "18C"},
                {"role": "assistant", "content": "18C in Paris."},
            ]
        },
        None,
    ),  # a turn that only calls a tool: trained (Qwen3.5 renders it without a content's blank line)
    (
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [{"function": TOOL_CALL}]},
                {"role": "tool", "content": "18C"},
                {"role": "assistant", "content": "18C in Paris."},
            ]
        },
        None,
    ),
]


def write_jsonl(path, records, raw_lines=()):
    with open(path, "wb") as f:
        for r in records:
            f.write((json.dumps(r) + "\n").encode())
        for line in raw_lines:
            f.write(line)
    return path


def test_malformed_records_are_skipped_and_counted_by_reason(tokenizer, tmp_path):
    data = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": GOOD}] + [r for r, _ in MALFORMED],
        raw_lines=[
            b"{not json\n",
            b'{"messages": "\xff\xfe"}\n',
            b"\xef\xbb\xbf" + json.dumps({"messages": GOOD}).encode(),
        ],
    )  # the last: a byte-order mark before a record (an editor's UTF-8 file), trained
    cfg = train.Config(dataset_name=str(data), max_seq_len=4096)
    blocks = list(train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1))
    expected = {}
    for _, reason in MALFORMED:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    expected["unreadable line"] = 2
    counts = blocks[-1]["position"].counts_at_end
    assert train.skip_reasons(counts) == expected
    assert counts["conversations"] == 2 + sum(reason is None for _, reason in MALFORMED)
    text = tokenizer.decode(blocks[0]["input_ids"][0][blocks[0]["labels"][0] != -100])
    assert "<tool_call>" in text and "get_weather" in text  # the tool call is part of the trained turn


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"not json at all\nnor this\n", "has no readable line: is it JSON lines?"),
        (
            b'{"question": []}\n',
            "has no column of a known form in its first records (its columns: ['question'])",
        ),
    ],
)
def test_structural_data_problems_say_what_to_fix(content, message, tmp_path):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        train.check_data(train.Config(dataset_name=str(path)), "train")


def test_a_split_the_dataset_lacks_says_which_it_has(tmp_path):
    """A dataset folder (or hub dataset) read through datasets, asked for a split it does not have."""
    (tmp_path / "data").mkdir()
    shutil.copy(SAMPLE, tmp_path / "data" / "part.jsonl")
    cfg = train.Config(dataset_name=str(tmp_path / "data"))  # dataset_split: train_sft; a folder's split is train
    with pytest.raises(train.UserError, match=r"cannot read dataset .*data \[train_sft\]: Bad split: train_sft. Avail"):
        train.check_data(cfg, "train")
    train.check_data(dataclasses.replace(cfg, dataset_split="train"), "train")


def run_train(tmp_path, tiny_model_dir, timeout=120, **job):
    config = write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **{"output_dir": str(tmp_path / "o"), **job})
    rc, out, err = run([sys.executable, "train.py", "--config", str(config)], timeout=timeout)
    return rc, out + err


@pytest.mark.parametrize(
    "job, message",
    [
        ({"data_format": "messages", "messages_column": "chat"}, "has no column of the form messages in its first rec"),
        ({"output_dir": "/dev/null/out"}, "output_dir /dev/null/out is not writable from rank 0"),
        ({"max_seq_len": 16384}, "max_seq_len 16384 exceeds the model's max_position_embeddings 8192"),
        ({"dataset_name": "__BAD__", "max_skip_fraction": 0.5}, "cannot be trained on (more than max_skip_fraction"),
    ],
    ids=["column", "output_dir", "block_length", "skip_fraction"],
)
def test_misconfiguration_fails_before_any_model_is_loaded(job, message, tiny_model_dir, tmp_path):
    if job.get("dataset_name") == "__BAD__":  # 60% of the records have no assistant turn
        bad = {"messages": [{"role": "user", "content": "anyone?"}]}
        job["dataset_name"] = str(write_jsonl(tmp_path / "bad.jsonl", [{"messages": GOOD}, bad, bad] * 5))
    rc, output = run_train(tmp_path, tiny_model_dir, **job)
    assert rc != 0 and message in output, output[-2000:]
    assert "model: " not in output and "Loading weights" not in output


def test_gated_model_without_token_says_to_set_hf_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    response = httpx2.Response(401, request=httpx2.Request("GET", "http://localhost/meta-llama/Llama-3.1-8B"))

    def gated():
        raise OSError("You are trying to access a gated repo.") from GatedRepoError("gated", response=response)

    with pytest.raises(train.UserError, match="is gated or private and HF_TOKEN is not set.*secrets: {HF_TOKEN"):
        train.from_hub(gated, "meta-llama/Llama-3.1-8B")
    monkeypatch.setenv("HF_TOKEN", "hf_x")  # with a token the hub's own error stands
    with pytest.raises(train.UserError, match="cannot load meta-llama/Llama-3.1-8B: You are trying to access a gated"):
        train.from_hub(gated, "meta-llama/Llama-3.1-8B")


def test_weights_are_read_from_safetensors_only(tiny_model_dir, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="has no .safetensors weights"):
        train.pretrained_dir(train.Config(model_name=str(pickled)))


def test_remote_code_is_not_run_unless_asked(tiny_model_dir, tmp_path):
    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["model_type"], config["auto_map"] = "evil", {"AutoConfig": "configuration_evil.EvilConfig"}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_evil.py").write_text("raise SystemExit('remote code ran')\n")
    assert train.Config().trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        train.model_config(custom)


def faulty_run(tmp_path, tiny_model_dir, fault, timeout=180, env=None):
    config = write_tiny_job(
        tmp_path / "job.yaml",
        tiny_model_dir,
        max_steps=8,
        save_every=2,
        param_dtype="float32",
        log_every=1,
        max_bad_steps=3,
        output_dir=str(tmp_path / "out"),
    )
    start = time.time()
    rc, out, err = run(
        [*TORCHRUN, str(WORKERS / "fault_worker.py"), str(config), fault], worker_env(**(env or {})), timeout
    )
    return rc, out + err, time.time() - start


@pytest.mark.distributed
def test_one_non_finite_step_is_skipped_on_every_rank_and_training_goes_on(tiny_model_dir, tmp_path):
    rc, output, _ = faulty_run(tmp_path, tiny_model_dir, "nan-once")
    assert rc == 0, output[-3000:]
    assert "step 2: non-finite loss or gradient norm, optimizer step skipped (1 in a row, 1 in all)" in output
    records = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 8 and steps[-1]["bad_steps"] == 1
    assert [r["step"] for r in steps if not math.isfinite(r["loss"])] == [2]  # its window has no loss: nan, not 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out/model")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.distributed
def test_non_finite_steps_in_a_row_stop_the_run_and_leave_the_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """Also: the MLflow run of a run that stops on an error ends FAILED, not FINISHED."""
    from mlflow.tracking import MlflowClient

    uri = f"file://{tmp_path}/mlruns"
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    rc, output, _ = faulty_run(tmp_path, tiny_model_dir, "nan-always", env=env)
    assert rc != 0
    assert "3 steps in a row with a non-finite loss or gradient norm at step 5: stopping" in output
    assert "The last checkpoint is " + str(tmp_path / "out/checkpoints/step_00000004") in output
    assert "or set a lower learning_rate in a new output_dir (a resume refuses a changed one)" in output
    assert (tmp_path / "out/checkpoints/step_00000004/complete.json").exists()
    runs = MlflowClient(uri).search_runs(["0"])
    assert [r.info.status for r in runs] == ["FAILED"] and "loss" in runs[0].data.metrics


@pytest.mark.parametrize("async_save", [True, False])
def test_a_checkpoint_write_that_fails_gets_the_faults_line_naming_its_cause(
    tiny_model_dir, tmp_path, monkeypatch, capsys, async_save
):
    """DCP wraps a failed write (here a full volume) in a CheckpointException, a BaseException whose first line names
    only the ranks: under torchrun the run still says the cause in one line, and what comes next."""
    import errno

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.FileSystemWriter, "write_data", full)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    settings = dict(max_steps=4, save_every=2, export=False, async_save=async_save, output_dir=str(tmp_path / "out"))
    with pytest.raises(dcp.CheckpointException):
        train.train(str(write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **settings)))
    fault = "rank 0: CheckpointException: OSError: [Errno 28] No space left on device\nattempt 1 of 2 failed"
    assert fault in capsys.readouterr().err


@pytest.mark.distributed
def test_an_exception_on_one_rank_ends_every_rank_without_hanging(tiny_model_dir, tmp_path):
    rc, output, seconds = faulty_run(tmp_path, tiny_model_dir, "raise", timeout=120)
    assert rc != 0 and "injected fault on rank 1" in output
    assert seconds < 90


def test_runs_without_a_launcher_take_no_port(tiny_model_dir, tmp_path, monkeypatch):
    """A world of one (python train.py, train() in a notebook's process) set MASTER_PORT=29500 in its environment
    and left the port bound in its process: a run started beside it failed with EADDRINUSE (seen in this suite).
    Now its group's store is in the process (HashStore), and the environment is left as it was."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for n in range(2):
        job = write_tiny_job(
            tmp_path / f"job{n}.yaml",
            tiny_model_dir,
            max_steps=1,
            num_workers=0,
            save_every=-1,
            export=False,
            output_dir=str(tmp_path / f"out{n}"),
        )
        assert train.train(str(job))["steps"] == 1
    assert "MASTER_PORT" not in os.environ  # nothing leaks into the processes started after it


def test_restarts_over_nodes_sharing_torchruns_store_are_refused_before_they_hang(monkeypatch):
    """Each node's torchrun counts its own restarts, so keys per attempt would differ between nodes."""
    env = dict(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_MAX_RESTARTS="2", LOCAL_WORLD_SIZE="8")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(train.UserError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        train.attempt_store(world_size=16)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a new store each attempt, hosted by rank 0
    assert train.attempt_store(world_size=16) is None


@pytest.mark.parametrize("timeout_s", [4.0, math.inf])
def test_the_collective_timeout_holds_from_the_first_steps_end_and_inf_means_none(world_of_one, timeout_s):
    """collective_timeout_s replaces the startup's timeout after step 1 for the training's and the host's collectives,
    not the checkpoints', and the startup's is back at the end; inf (no timeout) is a timeout of 1e7 s, not an
    OverflowError after the first step that every restart repeats."""
    groups = dist.group.WORLD, world_of_one.host_group, world_of_one.save_group
    training, host, save = (group._get_backend(torch.device("cpu")).options for group in groups)
    job = train.Job(train.Config(collective_timeout_s=timeout_s), world_of_one, *[None] * 4, train.Progress(), {})
    with train.HangWatch(job) as watch:
        watch.after_step(job, train.StepStats(max_blocks=1, blocks=1, loss_tokens=1, tokens=1, sum_sq_len=1))
        assert training._timeout == host._timeout == timedelta(seconds=min(timeout_s, 1e7))
        assert save._timeout == train.STARTUP_TIMEOUT  # a checkpoint's write to a slow volume is not a hang
    assert training._timeout == host._timeout == save._timeout == train.STARTUP_TIMEOUT
