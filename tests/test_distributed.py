"""Two ranks under torchrun (gloo, CPU): the global token-mean loss, end-to-end training, uneven shards."""

import json
import math
from collections import Counter

import pytest
import torch
from conftest import SAMPLE, WORKERS, torchrun, write_tiny_job
from transformers import AutoModelForCausalLM

import train

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "overrides, checkpointed",
    [
        ({"activation_checkpointing": 1.0, "compile": False}, [True, True]),
        ({"activation_checkpointing": 0.5, "compile": True}, [False, True]),  # half the layers recomputed
    ],
)
def test_two_ranks_with_unequal_loss_tokens_match_one_process_on_all_data(
    tiny_model_dir, tokenizer, conversations, tmp_path, overrides, checkpointed
):
    masker = train.AssistantMasker(tokenizer)
    ex = [masker(c) for c in conversations[:6]]

    # rank 0: three blocks holding five conversations; rank 1: one block holding one short conversation
    def block(segments, padding):
        return [segments, sum(len(ids) for ids, _ in segments) + padding]

    per_rank = [[block(ex[0:2], 30), block(ex[2:4], 0), block(ex[4:5], 200)], [block(ex[5:6], 10)]]
    (tmp_path / "blocks.json").write_text(json.dumps(per_rank))
    args = tmp_path / "blocks.json", tmp_path / "out.pt", json.dumps(overrides)
    torchrun(WORKERS / "grad_worker.py", tiny_model_dir, *args)
    got = torch.load(tmp_path / "out.pt")
    assert got["checkpointed"] == checkpointed and got["stepped"] == 1  # train_step's own normaliser, one step

    config = train.model_config(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config, attn_implementation="sdpa")
    blocks = [train.make_block(segs, n, 0) for rank in per_rank for segs, n in rank]
    weight = 1 / sum(b["loss_tokens"] for b in blocks)  # the global token mean's, as train_step weighs each loss
    losses = torch.cat([train.token_losses(model, b, loss_weight=weight) for b in blocks])
    (losses.sum() * weight).backward()
    assert got["n_micro"] == 3
    assert got["loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert (got["grads"][name] - p.grad).norm() <= 1e-5 * p.grad.norm(), name


def run_training(tmp_path, tiny_model_dir, data, **overrides):
    config = write_tiny_job(
        tmp_path / "job.yaml",
        tiny_model_dir,
        dataset_name=str(data),
        max_seq_len=2048,
        param_dtype="float32",
        learning_rate=3e-3,
        warmup_steps=2,
        log_every=1,
        output_dir=str(tmp_path / "out"),
        **overrides,
    )
    stdout = torchrun(WORKERS / "train_worker.py", config, tmp_path)
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
    for r in range(2):  # what reached each rank's loss (train_worker's step hook)
        results[r]["trained"] = json.loads((tmp_path / f"trained_{r}.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    return stdout, results, metrics


def test_two_rank_training_lowers_the_loss_and_ranks_agree(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(open(SAMPLE).readlines()[:120]))
    stdout, results, metrics = run_training(tmp_path, tiny_model_dir, data)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    trained = [r.pop("trained") for r in results]
    assert results[0] == results[1] and results[0]["steps"] == len(losses)
    # Both ranks took part in every step (their hooks ran at the same steps), each on blocks of its own.
    assert trained[0]["steps"] == trained[1]["steps"] == list(range(1, len(losses) + 1))
    ranks = [{tuple(ids) for _, ids in t["segments"]} for t in trained]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]
    packing = next(m["packing"] for m in metrics if "packing" in m)
    assert packing["conversations"] == 120 and results[0]["steps"] == max(packing["blocks_per_rank_min_max"])
    assert "step 1/" in stdout and "| loss " in stdout and "tok/s/cpu" in stdout  # per CPU rank


def test_uneven_shards_finish_without_hang_or_nan_and_train_every_conversation_once_per_epoch(
    tiny_model_dir, tokenizer, tmp_path
):
    # Records alternate between ranks (i % 2). Rank 1 gets mostly records without an assistant turn, so it
    # has far fewer conversations and runs out of blocks long before rank 0.
    lines = open(SAMPLE).readlines()[:60]
    bad = json.dumps({"messages": [{"role": "user", "content": "no answer here"}]}) + "\n"
    records = [line if i % 2 == 0 or i < 6 else bad for i, line in enumerate(lines)]
    data = tmp_path / "uneven.jsonl"
    data.write_text("".join(records))
    valid = 30 + 3
    stdout, results, metrics = run_training(
        tmp_path, tiny_model_dir, data, epochs=2, gradient_accumulation_steps=2, max_skip_fraction=0.95
    )
    # What reached the loss: in each epoch every trainable conversation exactly once, as the masker renders it.
    masker, conversations = train.AssistantMasker(tokenizer), [json.loads(line)["messages"] for line in records]
    expected = Counter(tuple(masker(c)[0][:2048]) for c in conversations if c[-1]["role"] == "assistant")
    assert sum(expected.values()) == valid
    segments = [segment for r in results for segment in r.pop("trained")["segments"]]
    for epoch in (0, 1):
        assert Counter(tuple(ids) for e, ids in segments if e == epoch) == expected, epoch
    assert {e for e, _ in segments} == {0, 1}
    packing = next(m["packing"] for m in metrics if "packing" in m)
    low, high = packing["blocks_per_rank_min_max"]
    assert packing["conversations"] == valid and packing["skipped_by_reason"] == {"no assistant turn": 27}
    assert high >= 4 * low
    seen = next(m["data_seen"] for m in metrics if "data_seen" in m)
    # Counts are of the data, not of the passes over it: 2 epochs train every block twice, and see each record once.
    assert seen["conversations"] == valid and seen["blocks"] == 2 * packing["blocks"]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == results[0]["steps"] == math.ceil(2 * high / 2)
    assert all(math.isfinite(x) for x in losses)
