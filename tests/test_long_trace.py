"""A reasoning trace of 100k+ tokens (tools/make_long_trace.py) through train.py's own masking, truncation and packing,
and through tools/inspect_data.py: the long-block data path on CPU (docs/LONG_BLOCKS.md)."""

import json
import sys

import inspect_data
import pytest
from make_long_trace import long_conversation, reasoning_of, write_long_trace
from test_masks import QWEN3_5, with_template

import train

LONG = 100_000  # reasoning tokens


@pytest.fixture(scope="module")
def qwen(tokenizer):
    return with_template(tokenizer, QWEN3_5)


@pytest.fixture(scope="module")
def trace(qwen, tmp_path_factory):
    """(file, its record, the reasoning's token count) of one conversation with LONG+ reasoning tokens."""
    path = tmp_path_factory.mktemp("long") / "trace.jsonl"
    written = write_long_trace(path, tokens=LONG, tokenizer=qwen)
    return path, json.loads(path.read_text()), written["conversations"][0]["tokens"]


@pytest.fixture(scope="module")
def rendered(qwen, trace):
    """(ids, mask) of the whole conversation, the prompt's ids, and the text that should be trained."""
    user, turn = trace[1]["messages"]
    ids, mask = train.AssistantMasker(qwen)(trace[1]["messages"])
    prompt = qwen.apply_chat_template([user], add_generation_prompt=True, tokenize=True, return_dict=False)
    trained = turn["reasoning_content"] + "\n</think>\n\n" + turn["content"] + "<|im_end|>"  # after `<think>\n`
    return ids, mask, prompt, trained


def blocks_of(path, tokenizer, max_seq_len: int) -> tuple[list[dict], dict]:
    """The blocks PackedBlocks makes of the file, and the stream's final counts."""
    cfg = train.Config(dataset_name=str(path), max_seq_len=max_seq_len)
    items = list(train.PackedBlocks(cfg, tokenizer, "train", rank=0, world_size=1, epochs=1))
    return [item for item in items if "input_ids" in item], items[-1]["position"].counts_at_end


def test_the_trace_is_seeded_and_at_least_as_long_as_asked(qwen, trace, tmp_path):
    assert LONG <= trace[2] < LONG + 64  # the fewest steps that reach it: one line more at most
    first = write_long_trace(tmp_path / "a.jsonl", tokens=2000, tokenizer=qwen, seed=3)
    again = write_long_trace(tmp_path / "b.jsonl", tokens=2000, tokenizer=qwen, seed=3)
    assert first["conversations"] == again["conversations"]
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    write_long_trace(tmp_path / "c.jsonl", tokens=2000, tokenizer=qwen, seed=4)
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes()
    by_words = write_long_trace(tmp_path / "w.jsonl", words=5000, seed=3, conversations=2)["conversations"]
    assert len(by_words) == 2 and all(5000 <= c["words"] < 5020 for c in by_words)


def test_the_mask_is_exactly_the_reasoning_the_answer_and_the_end_of_turn(qwen, trace, rendered):
    ids, mask, prompt, trained = rendered
    n = len(qwen(trained, add_special_tokens=False)["input_ids"])
    assert len(ids) > LONG and n > LONG
    assert ids[: len(prompt)] == prompt  # the question and the generation prompt, `<think>\n` last: no loss
    assert mask == [False] * len(prompt) + [True] * n + [False] * (len(ids) - len(prompt) - n)
    assert qwen.decode([t for t, m in zip(ids, mask) if m]) == trained
    assert qwen.decode(ids[len(prompt) + n :]) == "\n"  # after the end of turn only the template's newline
    # The same reasoning written as <think>...</think> in the content is the same sample.
    reasoning, n_steps, total = reasoning_of(0, 0, tokens=LONG, tokenizer=qwen)
    think = long_conversation(0, 0, reasoning, n_steps, total, form="think")
    assert think["messages"][1]["content"].startswith("<think>\n")
    assert train.AssistantMasker(qwen)(think["messages"]) == (ids, mask)


def test_a_block_longer_than_the_trace_holds_it_whole_with_exactly_its_loss_tokens(qwen, trace, rendered):
    ids, mask, prompt, trained = rendered
    (block,), counts = blocks_of(trace[0], qwen, max_seq_len=131_072)
    assert counts["conversations"] == 1 and counts.get("truncated", 0) == 0 and not train.skip_reasons(counts)
    assert block["tokens"] == len(ids) and block["input_ids"].shape == (1, 131_072)
    assert block["input_ids"][0, : len(ids)].tolist() == ids
    assert block["cu_seqlens"].tolist() == [0, len(ids), 131_072]  # the conversation, then a padding segment
    assert block["loss_tokens"] == sum(mask) == counts[0, "loss tokens"]
    labels = block["labels"][0].tolist()
    assert [i for i, label in enumerate(labels) if label != -100] == [i for i, m in enumerate(mask) if m]


def test_a_block_shorter_than_the_trace_truncates_it_counts_it_and_keeps_its_loss(qwen, trace, rendered):
    ids, mask, prompt, _ = rendered
    (block,), counts = blocks_of(trace[0], qwen, max_seq_len=4096)
    assert counts["truncated"] == 1 and counts["conversations"] == 1 and not train.skip_reasons(counts)
    assert block["tokens"] == 4096 and block["input_ids"].shape == (1, 4096)
    assert block["cu_seqlens"].tolist() == [0, 4096]  # exactly the block: no padding segment
    assert block["input_ids"][0].tolist() == ids[:4096]
    assert block["loss_tokens"] == 4096 - len(prompt) == sum(mask[:4096])
    # A block shorter than the prompt leaves no loss token: counted, and no block is made.
    assert len(prompt) > 16
    blocks, counts = blocks_of(trace[0], qwen, max_seq_len=16)
    assert blocks == [] and counts["truncated"] == 1 and counts["no loss tokens after truncation"] == 1


def test_inspect_data_shows_the_truncated_trace(tiny_model_dir, trace, monkeypatch, capsys):
    """The command line `tools/inspect_data.py 1 --dataset_name FILE --max_seq_len 8192 ...`, run in this process
    (tests/test_inspect.py starts the script itself; here that would double the file's time)."""
    argv = ["inspect_data.py", "1", "--model_name", str(tiny_model_dir), "--model_revision", ""]
    monkeypatch.setattr(sys, "argv", argv + ["--dataset_name", str(trace[0]), "--max_seq_len", "8192"])
    inspect_data.main()
    out = capsys.readouterr().out
    assert "=== block 0: 1 segments, 8192 tokens" in out
    assert "<think>\n⟦Step 1: the next number is" in out and out.count("⟦") == 1  # one loss span, from the reasoning
    assert "conversations 1 (+0 samples for earlier reasoning turns), truncated 1, skipped {}" in out
