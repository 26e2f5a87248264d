#!/usr/bin/env python3
"""Writes synthetic long reasoning traces as JSON lines, for checking masks, truncation and packing at long blocks.

Each record is a user question and an assistant turn whose reasoning is a seeded running sum, one step a line
("Step 17: the next number is 4213, and 51234 + 4213 = 55447."), then the total as the answer. Plain ASCII, no
special-token text, the same bytes for the same arguments. The reasoning's length is at least --tokens tokens of
--tokenizer, or without one at least --words words (every space-separated word is at least one token in a
tokenizer that splits at spaces). The reasoning goes into `reasoning_content`, or with --form think into the
content as `<think>...</think>` (train.py trains both alike on templates that render reasoning, such as Qwen3.5's).

    python tools/make_long_trace.py /tmp/long.jsonl --tokens 120000 --tokenizer .tiny-model
    python tools/make_long_trace.py /tmp/long.jsonl --words 100000 --conversations 2 --form think
"""

import argparse
import json
import random
from pathlib import Path

BATCH = 512  # steps written (and, with a tokenizer, counted) at a time


def steps(seed: int, index: int):
    """(line, running total) of each step of conversation index's running sum, without end."""
    draw, total, k = random.Random(f"make_long_trace/{seed}/{index}"), 0, 0
    while True:
        k, number = k + 1, draw.randint(100, 9999)
        line = f"Step {k}: the next number is {number}, and {total} + {number} = {total + number}."
        total += number
        yield line, total


def reasoning_of(seed: int, index: int, tokens: int = 0, words: int = 0, tokenizer=None) -> tuple[str, int, int]:
    """(reasoning, its steps, its final total): the fewest steps whose text reaches `tokens` tokens of tokenizer (each
    line counted with the newline after it, then the whole text checked) or `words` words."""
    lines, length, total, stream, goal = [], 0, 0, steps(seed, index), tokens or words
    while length < goal:
        batch = [next(stream) for _ in range(BATCH)]
        units = [line + "\n" for line, _ in batch]
        sizes = [len(ids) for ids in tokenizer(units, add_special_tokens=False)["input_ids"]] if tokens else None
        for i, (line, running) in enumerate(batch):
            if length >= goal:
                break
            lines.append(line)
            length += sizes[i] if tokens else len(line.split())
            total = running
    text = "\n".join(lines)
    while tokens and len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:  # the last line's newline
        line, total = next(stream)
        lines.append(line)
        text = "\n".join(lines)
    return text, len(lines), total


def long_conversation(seed: int, index: int, reasoning: str, n_steps: int, total: int, form: str) -> dict:
    """One record: the question, then the reasoning and the answer in the given form."""
    question = f"Add up the {n_steps} numbers of sequence {seed}-{index}, one at a time, and give the total."
    answer = f"The total of the {n_steps} numbers is {total}."
    turn = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    if form == "think":
        turn = {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}
    return {"messages": [{"role": "user", "content": question}, turn]}


def write_long_trace(
    out, tokens: int = 0, words: int = 0, tokenizer=None, seed: int = 0, conversations: int = 1, form: str = "reasoning"
) -> dict:
    """Writes the records to out; what was written: path, conversations, and per conversation its steps, words and
    (with a tokenizer) the reasoning's exact token count."""
    if (tokens > 0) == (words > 0) or tokens > 0 and tokenizer is None:
        raise ValueError("give tokens (and a tokenizer to count them) or words")
    records, stats = [], []
    for index in range(conversations):
        reasoning, n_steps, total = reasoning_of(seed, index, tokens, words, tokenizer)
        records.append(long_conversation(seed, index, reasoning, n_steps, total, form))
        counted = {"steps": n_steps, "words": len(reasoning.split())}
        if tokenizer is not None:
            counted["tokens"] = len(tokenizer(reasoning, add_special_tokens=False)["input_ids"])
        stats.append(counted)
    Path(out).write_text("".join(json.dumps(record) + "\n" for record in records))
    return {"path": str(out), "conversations": stats}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=0, help="reasoning tokens per conversation (with --tokenizer)")
    parser.add_argument("--tokenizer", default="", help="directory or hub name of the tokenizer that counts them")
    parser.add_argument("--words", type=int, default=0, help="reasoning words per conversation (default 100,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--form", choices=("reasoning", "think"), default="reasoning", help="where the reasoning goes")
    args = parser.parse_args()
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    words = args.words or (0 if args.tokens else 100_000)
    written = write_long_trace(args.out, args.tokens, words, tok, args.seed, args.conversations, args.form)
    print(f"wrote {written['path']}: {json.dumps(written['conversations'])}")
