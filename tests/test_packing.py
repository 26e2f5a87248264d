"""Packing properties, one per test, on the real pipeline (read -> mask -> pack) and on its pure parts."""

import json
import random
from collections import Counter

import pytest
import torch
from conftest import SAMPLE

import train


@pytest.fixture(scope="module")
def packed(tokenizer, tmp_path_factory):
    """The sample data packed into 2048-token blocks, with 3 over-long conversations added."""
    conversations = [json.loads(line) for line in open(SAMPLE)]
    long = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok " * 1200}]}
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations + [long] * 3))
    cfg = train.Config(dataset_name=str(path), max_seq_len=2048, pack_buffer_blocks=8)
    items = list(train.PackedBlocks(cfg, tokenizer, "train", rank=0, world_size=1, epochs=1))
    assert "input_ids" not in items[-1] and items[-1]["position"].counts_at_end == items[-2]["position"].counts_at_end
    return cfg, items[:-1], conversations  # the blocks; the last item is the stream's end, with its final counts


def segments(block):
    bounds = block["cu_seqlens"].tolist()
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < block["tokens"]]


def test_every_conversation_is_one_whole_segment_in_exactly_one_block(packed, tokenizer):
    cfg, blocks, conversations = packed
    expected = Counter(tuple(tokenizer.apply_chat_template(c["messages"], return_dict=False)) for c in conversations)
    found = Counter(tuple(blk["input_ids"][0, a:b].tolist()) for blk in blocks for a, b in segments(blk))
    truncated = [seg for seg in found if len(seg) == cfg.max_seq_len]
    assert len(truncated) == 1 and found[truncated[0]] == 3
    del found[truncated[0]]
    assert found == expected


def test_blocks_have_the_block_length_and_padding_only_at_the_end(packed):
    cfg, blocks, _ = packed
    for blk in blocks:
        assert blk["input_ids"].shape == (1, cfg.max_seq_len)
        last_real = segments(blk)[-1][1]
        assert last_real == blk["tokens"]
        assert (blk["labels"][0, last_real:] == -100).all()


def test_positions_reset_at_every_segment(packed):
    _, blocks, _ = packed
    for blk in blocks:
        bounds = blk["cu_seqlens"].tolist()
        expected = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        assert torch.equal(blk["position_ids"][0], expected)


def test_cu_seqlens_seq_idx_and_positions_agree(packed):
    _, blocks, _ = packed
    for blk in blocks:
        cu, seq_idx, pos = blk["cu_seqlens"], blk["seq_idx"][0], blk["position_ids"][0]
        assert cu.dtype == torch.int32 and seq_idx.dtype == torch.int32
        assert cu[0] == 0 and cu[-1] == pos.numel()
        starts = (pos == 0).nonzero().squeeze(1)
        assert torch.equal(starts.int(), cu[:-1])
        assert torch.equal(seq_idx, torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()).int())
        assert blk["max_length"] == int(cu.diff().max())


def test_labels_are_masked_on_every_segment_start_and_on_padding(packed):
    _, blocks, _ = packed
    for blk in blocks:
        labels = blk["labels"][0]
        assert (labels[blk["cu_seqlens"][:-1].long()] == -100).all()
        assert (labels[blk["tokens"] :] == -100).all()
        kept = labels != -100
        assert torch.equal(labels[kept], blk["input_ids"][0][kept])
        assert blk["loss_tokens"] == int(kept.sum())


def test_truncation_is_counted(packed):
    _, blocks, _ = packed
    assert blocks[-1]["position"].counts_at_end["truncated"] == 3
    assert blocks[-1]["position"].counts_at_end["conversations"] == 203


def test_make_block_worked_example():
    blk = train.make_block([([5, 6, 7], [False, True, True]), ([8, 9], [False, True])], 7, pad_id=0)
    assert blk["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert blk["cu_seqlens"].tolist() == [0, 3, 5, 7]
    assert blk["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert blk["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100]]
    assert (blk["max_length"], blk["tokens"], blk["loss_tokens"], blk["sum_sq_len"]) == (3, 5, 3, 13)


@pytest.mark.parametrize("pad, eos, expected", [(5, 7, 5), (None, 7, 7), (None, None, 0)])
def test_padding_is_the_pad_token_else_end_of_sequence_else_id_0(pad, eos, expected):
    tokenizer = type("Tokenizer", (), {"pad_token_id": pad, "eos_token_id": eos})()
    assert train.pad_token_id(tokenizer) == expected
    assert train.filler_block(train.pad_token_id(tokenizer))["input_ids"].eq(expected).all()


def test_best_fit_decreasing_fills_at_least_95_percent_on_ultrachat_like_lengths():
    # UltraChat 200k train_sft under the Qwen3.5 tokenizer: mean ~1.4k tokens, long right tail.
    rng = random.Random(0)
    lengths = [min(32768, int(rng.lognormvariate(7.0, 0.6))) for _ in range(64 * 32768 // 1300)]
    bins = train.best_fit_decreasing(lengths, 32768)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 32768 for b in bins)
    fill = sum(lengths) / (len(bins) * 32768)
    assert fill >= 0.95, fill


def test_each_buffers_emptiest_block_waits_for_the_next_buffer_so_only_the_streams_last_is_sparse(tokenizer):
    """Buffers of 2 blocks' worth: packed alone, every buffer would end in a sparse block (the fill then falls to
    0.18); carried into the next buffer, every block but the stream's last is at least 70% full, fewer blocks hold
    the same conversations, and each of those is in exactly one block."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=2048, pack_buffer_blocks=2)
    blocks = [b for b in train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1) if "input_ids" in b]
    fills = [b["tokens"] / cfg.max_seq_len for b in blocks]
    assert min(fills[:-1]) >= 0.7 and fills[-1] < 0.7 and len(blocks) <= 80, (len(blocks), min(fills[:-1]))
    assert sum(bool(b["position"].carried) for b in blocks) > len(blocks) / 2
    seen = Counter(tuple(b["input_ids"][0, x:y].tolist()) for b in blocks for x, y in segments(b))
    assert sum(seen.values()) == 200 and max(seen.values()) == 1


def test_disjoint_shards_cover_the_data_once(tokenizer):
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=2048)
    seen = Counter()
    for rank in range(3):
        for blk in train.PackedBlocks(cfg, tokenizer, "train", rank, 3, epochs=1):
            if "input_ids" in blk:  # not the stream's end
                seen.update(tuple(blk["input_ids"][0, a:b].tolist()) for a, b in segments(blk))
    assert sum(seen.values()) == 200 and max(seen.values()) == 1


def test_eval_fraction_holds_out_records_that_are_never_trained(tokenizer):
    """The held-out records are the same on any number of ranks and are never in a training block."""
    cfg = train.Config(dataset_name=str(SAMPLE), max_seq_len=2048, eval_fraction=0.1)

    def conversations(part, world_size):
        seen = Counter()
        for rank in range(world_size):
            for blk in train.PackedBlocks(cfg, tokenizer, part, rank, world_size, epochs=1):
                if "input_ids" in blk:
                    seen.update(tuple(blk["input_ids"][0, a:b].tolist()) for a, b in segments(blk))
        return seen

    trained, held_out = conversations("train", 1), conversations("eval", 1)
    assert not set(trained) & set(held_out)
    assert sum(trained.values()) + sum(held_out.values()) == 200 and 10 <= sum(held_out.values()) <= 30
    assert conversations("eval", 2) == held_out and conversations("train", 3) == trained


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"dataset_name": "data.jsonl", "eval_split": "data.jsonl"}, "is the training data"),
        ({"dataset_name": "data.jsonl", "eval_split": "test"}, "is the training data"),  # a file has no splits
        ({"eval_split": "train_sft"}, "is the training data"),
        ({"dataset_name": "a.jsonl", "eval_split": "./a.jsonl"}, "is the training data"),  # one file, two spellings
        ({"eval_split": "test_sft", "eval_fraction": 0.1}, "set eval_split or eval_fraction, not both"),
    ],
)
def test_eval_on_the_training_data_is_refused(settings, message):
    with pytest.raises(train.UserError, match=message):
        train.Config(**settings)
    assert train.Config(eval_split="test_sft").eval_split == "test_sft"  # a hub dataset's other split
    assert train.Config(dataset_name="data.jsonl", eval_split="held_out.jsonl").eval_fraction == 0
    assert train.Config(dataset_split="", eval_split="").eval_split == ""  # no eval at all
