"""Sharded loading, the Hugging Face export, resume after a SIGKILL or SIGTERM, on 2 CPU ranks under torchrun; the
checkpoint's contents and policy in one process. Restarts inside the job: test_restarts.py."""

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    ROOT,
    SAMPLE,
    TORCHRUN,
    WORKERS,
    job,
    kill_all,
    losses_by_step,
    run_ok,
    run_process,
    stream_blocks,
    tensors,
    torchrun,
    worker_env,
    write_tiny_job,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import train


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def bf16_checkpoint(request, tmp_path_factory):
    """A tiny checkpoint stored in bf16 except the tensors qwen3_5 keeps in fp32 (A_log, norms), and for the
    hybrid an extra mtp.* tensor that the model has no module for, as the real Qwen3.5 checkpoints have."""
    from make_tiny_model import make_model, make_tokenizer

    path = tmp_path_factory.mktemp(request.param) / "model"
    tok = make_tokenizer()
    model = make_model(len(tok), hybrid=request.param == "hybrid")
    for name, p in model.named_parameters():
        if "A_log" not in name and "norm" not in name:
            p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if request.param == "hybrid":
        weights = load_file(path / "model.safetensors")
        weights["mtp.fc.weight"] = torch.randn(8, 8).to(torch.bfloat16)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return request.param, path


def auto_class(kind):
    return AutoModelForImageTextToText if kind == "hybrid" else AutoModelForCausalLM


@pytest.mark.distributed
def test_sharded_load_equals_from_pretrained_and_the_export_keeps_every_tensor(bf16_checkpoint, tmp_path):
    kind, source = bf16_checkpoint
    torchrun(WORKERS / "export_worker.py", source, tmp_path)
    got = torch.load(tmp_path / "fsdp.pt")
    reference = auto_class(kind).from_pretrained(source, dtype=torch.float32)
    for name, p in reference.named_parameters():
        assert got["params"][name].dtype == torch.float32  # fp32 master weights
        assert torch.equal(got["params"][name], p), name
    buffers = dict(reference.named_buffers())
    assert got["buffers"].keys() == buffers.keys()
    for name, b in buffers.items():
        assert torch.equal(got["buffers"][name], b), name  # rotary tables computed, not left empty

    exported, original = tensors(tmp_path / "model"), tensors(source)
    assert exported.keys() == original.keys() and "model.safetensors.index.json" in os.listdir(tmp_path / "model")
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    reloaded = auto_class(kind).from_pretrained(tmp_path / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = reloaded(input_ids=got["input_ids"], use_cache=False).logits
    assert torch.allclose(logits, got["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_resume_after_sigkill_trains_the_same_data_to_bit_identical_weights(tiny_model_dir, straight, tmp_path):
    data, straight = straight
    env = worker_env()
    command, killed = job(tmp_path, tiny_model_dir, "killed", data, log_every=2)
    victim = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not list(killed.glob("checkpoints/step_*/complete.json")) and time.time() < deadline:
        time.sleep(0.05)
    assert kill_all(str(tmp_path / "killed.yaml")) >= 3  # torchrun, its two ranks and their data workers
    victim.wait()
    assert not (killed / "model").exists(), "the run finished before it could be killed"
    first_checkpoint = sorted(killed.glob("checkpoints/step_*"))[0].name
    assert f"resumed from {killed}/checkpoints/{first_checkpoint}" in run_ok(command, env)

    expected = losses_by_step(straight)
    assert losses_by_step(killed) == expected and {2, 3, 4, 6} <= set(expected)
    a, b = tensors(straight / "model"), tensors(killed / "model")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    kept = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert len(kept) == 2 and first_checkpoint not in kept  # keep_checkpoints: 2


@pytest.mark.distributed
def test_the_export_after_training_is_the_trained_model_tensor_by_tensor(tiny_model_dir, straight, tmp_path):
    """Every exported tensor equals the final checkpoint's weights (read back by DCP alone, no train.py), each
    differs from the source checkpoint's, so none was copied untrained, and the reloaded model's logits are the
    FSDP model's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, straight = straight
    final = sorted((straight / "checkpoints").iterdir())[-1]
    dcp_to_torch_save(final, tmp_path / "final.pt")
    trained = torch.load(tmp_path / "final.pt")["model"]
    exported, source = tensors(straight / "model"), tensors(tiny_model_dir)
    assert exported.keys() == source.keys() == trained.keys()
    for name, t in exported.items():
        assert t.dtype == source[name].dtype and torch.equal(t, trained[name].to(t.dtype)), name
        assert not torch.equal(t, source[name]), f"{name} was exported untrained"
    torchrun(WORKERS / "export_worker.py", straight / "model", tmp_path / "check", final)
    got = torch.load(tmp_path / "check/fsdp.pt")
    reloaded = AutoModelForCausalLM.from_pretrained(straight / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = reloaded(input_ids=got["input_ids"], use_cache=False).logits
    assert torch.allclose(logits, got["logits"], rtol=1e-5, atol=1e-5)


def test_a_stream_stopped_after_an_odd_number_of_blocks_resumes_on_the_same_blocks(tokenizer):
    """Two DataLoader workers take turns, so three blocks leave the turn with worker slot 1: a resumed loader must
    start there (Progress.next_slot), and then the stream goes on with exactly the blocks an unbroken one yields."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=1024, pack_buffer_blocks=2, num_workers=2)

    blocks = partial(stream_blocks, cfg, tokenizer)

    whole = blocks(train.Progress())
    stopped = train.Progress()
    first = blocks(stopped, n=3)
    assert stopped.next_slot == 1 and len(whole) > 6
    rest = blocks(train.Progress(), resume=stopped)
    assert len(first + rest) == len(whole) and all(torch.equal(a, b) for a, b in zip(first + rest, whole))


def test_a_stream_stopped_in_a_buffer_that_began_with_carried_samples_resumes_on_the_same_blocks(tokenizer):
    """A buffer begins with the last one's emptiest block (StreamPosition.carried): a stream stopped after its first
    block must read those samples again from their records, before the buffer's first, and pack the same blocks."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=1024, pack_buffer_blocks=2, num_workers=0)

    blocks = partial(stream_blocks, cfg, tokenizer)

    whole = blocks(train.Progress())
    positions = [b["position"] for b in train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1) if "input_ids" in b]
    stop = next(n for n, p in enumerate(positions, 1) if p.carried and p.taken == 1 and p.buffer >= 2)
    stopped = train.Progress()
    first = blocks(stopped, n=stop)
    assert stopped.streams[0].carried and stopped.streams[0].record > max(r for r, _ in stopped.streams[0].carried)
    rest = blocks(train.Progress(), resume=stopped)
    assert len(first + rest) == len(whole) and all(torch.equal(a, b) for a, b in zip(first + rest, whole))


def test_a_checkpoint_written_by_another_number_of_ranks_is_refused_before_anything_loads(world_of_one, tmp_path):
    """Its shards and each rank's data position belong to as many ranks: a resume on 1 of a 2-rank run stops."""
    with pytest.raises(train.UserError, match="was written by 2 ranks; resume with as many, or use another output_dir"):
        train.resume_progress(tmp_path, {"world_size": 2, "config": {}}, train.Config(), world_of_one)


def test_a_two_epoch_stream_stopped_in_its_first_epoch_resumes_on_the_same_blocks_in_both(tokenizer):
    """A resume mid-epoch starts that epoch at its position, and the next epoch from its beginning."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=1024, pack_buffer_blocks=2, num_workers=0, epochs=2)

    blocks = partial(stream_blocks, cfg, tokenizer, epochs=2)

    whole = blocks(train.Progress())
    stopped = train.Progress()
    first = blocks(stopped, n=len(whole) // 4)
    assert stopped.streams[0].epoch == 0 and stopped.streams[0].record > 0
    rest = blocks(train.Progress(), resume=stopped)
    assert len(first + rest) == len(whole) and all(torch.equal(a, b) for a, b in zip(first + rest, whole))


def test_an_odd_block_count_with_accumulation_trains_every_block_in_a_last_short_step(
    tiny_model_dir, tokenizer, tmp_path
):
    """The step count rounds up: 2 blocks a step over an odd count ends in a step of one block, not a dropped one."""
    lines, data = open(SAMPLE).readlines(), tmp_path / "data.jsonl"
    cfg = train.Config(dataset_name=str(data), max_seq_len=1024, num_workers=0)
    for n in range(12, len(lines)):  # the fewest records (from 12) that pack into an odd number of blocks
        data.write_text("".join(lines[:n]))
        if len(blocks := stream_blocks(cfg, tokenizer, train.Progress())) % 2:
            break
    settings = dict(dataset_name=str(data), gradient_accumulation_steps=2, save_every=-1, export=False)
    result = train.train(
        str(write_tiny_job(tmp_path / "job.yaml", tiny_model_dir, **settings, output_dir=str(tmp_path / "o")))
    )
    seen = [r["data_seen"] for r in map(json.loads, open(tmp_path / "o/metrics.jsonl")) if "data_seen" in r]
    assert result["steps"] == (len(blocks) + 1) // 2 and seen[-1]["blocks"] == len(blocks), (len(blocks), seen, result)


@pytest.mark.distributed
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tiny_model_dir, straight, tmp_path):
    """Saves at steps 3 and 6 run in the background (async_save); step 3's completes during step 4. Every rank
    dies in step 7, before the ranks have agreed that step 6's write is done: step 6 has no complete.json, and
    the rerun resumes from step 3 and ends bit-identical to a run never interrupted."""
    data, straight = straight
    command, killed = job(tmp_path, tiny_model_dir, "killed", data, log_every=2)
    faulty = [*TORCHRUN, str(WORKERS / "fault_worker.py"), str(tmp_path / "killed.yaml"), "kill-at-7"]
    proc = run_process(faulty, cwd=ROOT, env=worker_env(), timeout=300)
    assert proc.returncode != 0 and "step 6/" in proc.stdout and "step 7/" not in proc.stdout, proc.stdout[-2000:]
    assert (killed / "checkpoints/step_00000006").is_dir()
    assert [p.name for p in train.complete_checkpoints(train.Config(output_dir=str(killed)))] == ["step_00000003"]
    assert f"resumed from {killed}/checkpoints/step_00000003" in run_ok(command)
    assert losses_by_step(killed) == losses_by_step(straight)
    a, b = tensors(straight / "model"), tensors(killed / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_sigterm_saves_after_the_step_and_the_restart_is_bit_identical(tiny_model_dir, straight, tmp_path):
    """torchrun forwards a SIGTERM to its workers (and their data workers, which ignore it); the ranks agree to
    stop at the next step, save, and exit non-zero well within torchrun's 30 s before its SIGKILL."""
    data, straight = straight
    command, stopped = job(tmp_path, tiny_model_dir, "stopped", data, log_every=2)
    faulty = [*TORCHRUN, str(WORKERS / "fault_worker.py"), str(tmp_path / "stopped.yaml"), "sigterm-launcher-at-4"]
    proc = run_process(faulty, cwd=ROOT, env=worker_env(), timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SIGTERM: stopping after step " in output, output[-3000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+); the newest checkpoint is", output)[1])
    assert step in (4, 5) and not (stopped / "model").exists()
    assert (stopped / f"checkpoints/step_{step:08d}/complete.json").exists()
    assert f"resumed from {stopped}/checkpoints/step_{step:08d}" in run_ok(command)
    # The stop logs its step early, so the log windows after it differ; the losses before it and the weights do not.
    expected = losses_by_step(straight)
    assert {k: v for k, v in losses_by_step(stopped).items() if k <= step and k in expected} == {
        k: v for k, v in expected.items() if k <= step
    }
    a, b = tensors(straight / "model"), tensors(stopped / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_interrupted_saves_are_never_resumed_from(tmp_path):
    cfg = train.Config(output_dir=str(tmp_path))
    for step, complete in ((3, True), (6, True), (9, False)):
        path = tmp_path / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        if complete:
            (path / "complete.json").write_text("{}")
    assert [p.name for p in train.complete_checkpoints(cfg)] == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize("master", ["float32", "bfloat16"])
def test_fsdp2_placements_and_master_dtype(tiny_model_dir, world_of_one, master):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    cfg = train.Config(model_name=str(tiny_model_dir), master_dtype=master, compile=False)
    model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
    layers = model.get_decoder().layers
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.dtype == getattr(torch, master)
    policy = layers[0]._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    optimizer, _ = train.make_optimizer(model, cfg, total_steps=10)
    train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    losses = model.token_losses(train.make_block([([5, 6, 7, 8], [False, True, True, True])], 6, 0))
    losses.sum().backward()
    optimizer.step()
    state = optimizer.state[next(iter(model.parameters()))]
    assert state["exp_avg"].dtype == getattr(torch, master)


def test_weight_decay_skips_vectors_and_embeddings_and_each_group_has_the_settings(world_of_one, tmp_path):
    from make_tiny_model import write_tiny_model

    source = write_tiny_model(tmp_path / "hybrid", hybrid=True)
    cfg = train.Config(model_name=str(source), weight_decay=0.1, compile=False, adam_beta1=0.8, adam_beta2=0.99)
    model = train.build_model(train.model_config(source), cfg, "sdpa", world_of_one.device)
    optimizer, _ = train.make_optimizer(model, cfg, total_steps=10)
    assert all(
        g["betas"] == (0.8, 0.99) and g["fused"] and g["initial_lr"] == cfg.learning_rate
        for g in optimizer.param_groups
    )
    names = {id(p): n for n, p in model.named_parameters()}
    (decayed, decay), (kept, no_decay) = (
        (sorted(names[id(p)] for p in g["params"]), g["weight_decay"]) for g in optimizer.param_groups
    )
    assert (decay, no_decay) == (0.1, 0.0)
    assert all(model.get_parameter(n).ndim >= 2 and "embed_tokens" not in n for n in decayed)
    assert all(model.get_parameter(n).ndim == 1 or "embed_tokens" in n for n in kept)
    for kind in ("A_log", "dt_bias", "norm.weight", "embed_tokens.weight"):
        assert any(n.endswith(kind) for n in kept), kind
    assert any(n.endswith("q_proj.weight") for n in decayed) and any(n.endswith("in_proj_qkv.weight") for n in decayed)


def test_a_resumed_run_with_a_larger_max_steps_trains_on(tiny_model_dir, tmp_path):
    command, out = job(tmp_path, tiny_model_dir, "extend", SAMPLE)
    command = [sys.executable, *command[command.index("train.py") :]]  # one process
    run_ok([*command, "--max_steps", "3", "--num_workers", "0"])
    output = run_ok([*command, "--max_steps", "5", "--num_workers", "0"])
    assert f"resumed from {out}/checkpoints/step_00000003 (step 3 of 3)" in output
    assert sorted(losses_by_step(out)) == [1, 2, 3, 4, 5] and "step 5/5" in output
    cfg = train.load_config(("saved", yaml.safe_load((out / "config.yaml").read_text())))
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    five = {step: cfg.learning_rate * train.lr_factor(step - 1, cfg, 5) for step in range(1, 6)}
    assert lrs == pytest.approx(five) and five[4] > 5 * cfg.learning_rate * train.lr_factor(3, cfg, 3)  # step 4 too


def test_a_trial_run_resumed_without_max_steps_counts_its_data_and_trains_to_its_end(tiny_model_dir, tmp_path):
    """max_steps 0 on the resume of a max_steps run (a trial continued as the full pass): the data is counted, as it
    is for a run started so, and the run trains on to the counted end. A counted run's resume keeps its count."""
    (data := tmp_path / "twenty.jsonl").write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:20]))
    command, out = job(tmp_path, tiny_model_dir, "trial", data, export=False)
    command = [sys.executable, *command[command.index("train.py") :], "--num_workers", "0"]  # one process
    run_ok([*command, "--max_steps", "2"])
    output = run_ok(command)
    counted = int(re.search(r'^data: \{"blocks": (\d+),', output, re.M)[1])
    steps = math.ceil(counted / 2)  # gradient_accumulation_steps 2
    assert steps > 3 and "(step 2 of 2)" in output and f"step {steps}/{steps}" in output, output[-3000:]
    again = run_ok(command)  # a counted run's checkpoint: its count, no counting pass
    assert "data: " not in again and f"(step {steps} of {steps})" in again


def test_a_vlm_layout_model_saves_and_resumes_with_its_vision_tower_frozen(world_of_one, tmp_path):
    """qwen3_5 loads with its image-text class; its vision tower gets no gradient in text SFT. Frozen, it holds
    no optimizer state, so the optimizer state a fresh run expects matches the checkpoint's."""
    from make_tiny_model import write_tiny_model

    source = write_tiny_model(tmp_path / "hybrid", hybrid=True)
    cfg = train.Config(model_name=str(source), param_dtype="float32", output_dir=str(tmp_path / "out"), compile=False)
    config = train.model_config(source)
    model = train.build_model(config, cfg, "sdpa", world_of_one.device)
    frozen = sorted({n.split(".")[1] for n, p in model.named_parameters() if not p.requires_grad})
    assert frozen == ["visual"] and all(p.requires_grad for p in model.get_decoder().parameters())
    optimizer, scheduler = train.make_optimizer(model, cfg, total_steps=10)
    train.load_pretrained(model, source, train.checkpoint_dtypes(source))
    ids = torch.arange(3, 40)[None]
    model(input_ids=ids, labels=ids).loss.backward()  # one sequence: no packed signals, no kernels needed
    optimizer.step()
    counts = {"conversations": 60}, {"conversations": 90, "unknown role": 2}
    position = train.StreamPosition(
        slot=0, epoch=0, record=64, buffer=1, counts_at_start=counts[0], counts_at_end=counts[1], taken=3
    )
    progress = train.Progress(step=1, streams={0: position}, blocks=7)
    checkpointer = train.Checkpointer(train.Job(cfg, world_of_one, model, optimizer, scheduler, 10, progress, {}))
    checkpointer.prepare()  # the host buffers, allocated in a background thread before the first save
    checkpointer.preparing.join()
    prepared = dict(checkpointer.buffers)
    checkpointer.save()  # in the background (async_save), completed by finish()
    assert prepared.keys() == checkpointer.buffers.keys()
    assert all(checkpointer.buffers[key] is buffer for key, buffer in prepared.items())
    model(input_ids=ids, labels=ids).loss.backward()  # the weights move on after the first save
    optimizer.step()
    progress.step, buffers = 2, dict(checkpointer.buffers)
    checkpointer.save()  # waits for the first write, then stages into the same host buffers
    assert buffers and all(checkpointer.buffers[key] is buffer for key, buffer in buffers.items())
    checkpointer.finish()

    fresh = train.build_model(config, cfg, "sdpa", world_of_one.device)
    fresh_optimizer, fresh_scheduler = train.make_optimizer(fresh, cfg, total_steps=10)
    path = train.complete_checkpoints(cfg)[-1]
    meta = json.loads((path / "complete.json").read_text())
    resumed = train.resume_progress(path, meta, cfg, world_of_one)
    train.resume_weights(path, meta, fresh, fresh_optimizer, fresh_scheduler, world_of_one)
    assert resumed == progress  # the data positions survive the round trip
    moments = train.HostMoments(fresh_optimizer, world_of_one.device).moments()  # each may leave the device alone:
    assert moments and all(m.untyped_storage().nbytes() == m.nbytes for m in moments)  # none shares its storage
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    with pytest.raises(ValueError, match=r"other \['learning_rate'\]"):
        train.resume_progress(path, meta, train.Config(**{**cfg.__dict__, "learning_rate": 2e-5}), world_of_one)


def test_random_init_needs_no_weights_and_writes_only_what_is_asked(tiny_model_dir, tmp_path):
    """init: random (what the benchmark runs: a geometry's config.json, no weights), save_every -1 and export
    off: nothing written but the log. With export on, the model is exported in the compute dtype, with the
    model's own initialisation (linear weights ~ N(0, initializer_range), norms at one)."""
    geometry = tmp_path / "geometry"
    geometry.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, geometry / f.name)
    job = dict(model_name=str(geometry), init="random", max_steps=2, num_workers=0, param_dtype="bfloat16")
    quiet = write_tiny_job(
        tmp_path / "quiet.yaml", geometry, **job, save_every=-1, export=False, output_dir=str(tmp_path / "quiet")
    )
    result = train.train(str(quiet))  # train() takes a YAML file's path too
    assert result["steps"] == 2 and result["model_dir"] is None
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["config.yaml", "metrics.jsonl"]
    exported = write_tiny_job(tmp_path / "exported.yaml", geometry, **job, output_dir=str(tmp_path / "exported"))
    model_dir = train.train(str(exported))["model_dir"]
    # Stored in param_dtype's bfloat16, not in the float32 master weights' dtype
    assert {t.dtype for t in tensors(Path(model_dir)).values()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    std = model.config.initializer_range
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(float(weight.detach().std()) - std) < 0.2 * std
    assert torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight), atol=1e-2)


def test_save_every_minutes_saves_by_the_clock_and_each_save_logs(tiny_model_dir, tmp_path):
    """save_every 0 (only at the end) with save_every_minutes: a save whenever the interval has passed since the
    last (here a few microseconds, so after every step), each with its log line; keep_checkpoints prunes."""
    out = tmp_path / "out"
    job = write_tiny_job(
        tmp_path / "job.yaml",
        tiny_model_dir,
        max_steps=3,
        num_workers=0,
        save_every=0,
        save_every_minutes=1e-7,
        log_every=10,
        export=False,
        output_dir=str(out),
    )
    train.train(str(job))
    assert sorted(losses_by_step(out)) == [1, 2, 3]
    assert [p.name for p in train.complete_checkpoints(train.Config(output_dir=str(out)))] == [
        "step_00000002",
        "step_00000003",
    ]


def test_the_export_of_a_base_model_trained_with_a_chat_tokenizer_stops_at_the_end_of_turn(tiny_model_dir, tmp_path):
    """Base weights with another (chat) tokenizer, as the Llama example's: the export has the chat tokenizer's
    files, not the base's, and generate() stops at the template's end-of-turn token, which the model learned."""
    from transformers import AutoTokenizer, GenerationConfig

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    base_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base_tok.eos_token, base_tok.chat_template = "<|endoftext|>", None  # a base model's: no turns
    base_tok.save_pretrained(base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    GenerationConfig(eos_token_id=base_tok.eos_token_id).save_pretrained(base)
    # The chat tokenizer's own eos is not its end-of-turn token either (as Llama 3.1's <|end_of_text|>): only the
    # template's end of turn, which the masks trained, can stop generation.
    chat_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat_tok.eos_token = "<|endoftext|>"
    chat_tok.save_pretrained(tmp_path / "chat")
    data = tmp_path / "short.jsonl"
    with open(data, "w") as f:
        for i in range(64):
            answer = {"role": "assistant", "content": "ok"}
            f.write(json.dumps({"messages": [{"role": "user", "content": f"say ok {i}"}, answer]}) + "\n")
    job = write_tiny_job(
        tmp_path / "job.yaml",
        base,
        tokenizer_name=str(tmp_path / "chat"),
        dataset_name=str(data),
        max_seq_len=256,
        epochs=8,
        learning_rate=3e-3,
        warmup_steps=2,
        save_every=-1,
        output_dir=str(tmp_path / "out"),
    )
    assert run_ok([sys.executable, "train.py", "--config", str(job)])
    out = tmp_path / "out/model"
    tok = AutoTokenizer.from_pretrained(out)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_template and tok.eos_token == "<|endoftext|>"  # the tokenizer trained with, not the base's
    assert end_of_turn in GenerationConfig.from_pretrained(out).eos_token_id
    conversation = [{"role": "user", "content": "say ok 3"}, {"role": "assistant", "content": "ok"}]
    text = tok.apply_chat_template(conversation, tokenize=False)
    prompt = tok(text[: text.rindex("ok<|im_end|>")], add_special_tokens=False, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(out)
    new = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert new[-1] == end_of_turn and len(new) < 20 and tok.decode(new[:-1]) == "ok", tok.decode(new)


def test_staging_buffers_are_pinned_in_their_tensors_gpu_context_also_from_a_thread(monkeypatch):
    """host_buffer pins in place with cudaHostRegister, which acts in the calling thread's current GPU. The staging
    thread's (Checkpointer.prepare) is GPU 0 unless set: rank 3 would open a context on GPU 0 (memory there) and pin
    its buffers for GPU 0. CUDA is faked here: which GPU is current when each buffer is registered."""
    current, calls = [0], []

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], torch.device(index).index
        yield
        current[0] = before

    class Cudart:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append((current[0], size))

        def cudaHostUnregister(self, pointer):
            pass

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    like = types.SimpleNamespace(shape=(4, 2), dtype=torch.float32, is_cuda=True, device=torch.device("cuda", 3))
    buffers = []
    thread = threading.Thread(target=lambda: buffers.append(train.host_buffer(like)))
    thread.start()
    thread.join()
    assert calls == [(3, 32)] and buffers[0].shape == (4, 2) and current == [0]
    cpu = train.host_buffer(torch.zeros(3))  # a host tensor's copy needs no pinning
    assert calls == [(3, 32)] and cpu.shape == (3,)


def test_the_export_takes_the_indexed_weights_and_copies_no_other_weight_file(world_of_one, tmp_path):
    """A source as Mistral's hub repos lay it out (consolidated.safetensors: the weights again, in other names, beside
    the indexed shards), with a stale pytorch_model.bin and its index, a license and a processor config: the export
    holds the indexed tensors only, none of the other weight files, and the source's other files."""
    from make_tiny_model import make_model, make_tokenizer

    source, tok = tmp_path / "source", make_tokenizer()
    make_model(len(tok)).save_pretrained(source, max_shard_size="100KB")  # several shards and an index
    tok.save_pretrained(source)
    indexed = tensors(source)
    save_file({f"native.{i}": t for i, t in enumerate(indexed.values())}, source / "consolidated.safetensors")
    torch.save({"stale": torch.zeros(1)}, source / "pytorch_model.bin")
    (source / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"stale": "pytorch_model.bin"}}))
    for name in ("LICENSE", "README.md", "modeling_extra.py", "preprocessor_config.json"):
        (source / name).write_text("{}")
    cfg = train.Config(model_name=str(source), param_dtype="float32", output_dir=str(tmp_path / "out"), compile=False)
    dtypes = train.checkpoint_dtypes(source)
    assert dtypes.keys() == indexed.keys()
    model = train.build_model(train.model_config(source), cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, source, dtypes)
    out = train.export_hf(model, tok, source, dtypes, cfg, world_of_one)
    exported = tensors(out)
    assert exported.keys() == indexed.keys() and all(torch.equal(exported[k], t) for k, t in indexed.items())
    files = {f.name for f in out.iterdir()}
    assert {"LICENSE", "README.md", "modeling_extra.py", "preprocessor_config.json", "config.json"} <= files
    assert not files & {"consolidated.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json"}, files


def test_a_run_that_would_export_over_the_model_it_trains_from_stops_at_start(tiny_model_dir, tmp_path):
    """output_dir/model is emptied by the export: a run whose model_name is it (a second stage in the first one's
    output_dir) would delete its own source and export without a config. It stops before anything loads."""
    shutil.copytree(tiny_model_dir, tmp_path / "out/model")
    job = write_tiny_job(tmp_path / "job.yaml", tmp_path / "out/model", output_dir=str(tmp_path / "out"), max_steps=2)
    proc = run_process([sys.executable, "train.py", "--config", str(job)], cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and f"is {tmp_path}/out/model, which the export replaces" in proc.stderr, proc.stderr
    assert (tmp_path / "out/model/config.json").exists() and not (tmp_path / "out/config.yaml").exists()
    proc = run_process([sys.executable, "train.py", "--config", str(job), "--export", "false"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
