#!/usr/bin/env python3
"""What train.py will train on, before any GPU time is spent: this rank's first N packed blocks, each segment
decoded with its loss spans marked with ⟦ ⟧, the packing statistics, and optionally the blocks' signals as JSON
lines. Needs the tokenizer only (model_name may be a directory that holds nothing else); takes train.py's flags.

    python tools/inspect_data.py N [--out blocks.jsonl] [--config job.yaml] [--KEY VALUE ...]
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, as a script
import train  # noqa: E402


def inspect_blocks(cfg: train.Config, n: int, out_path: str) -> None:
    """Prints this rank's first n packed blocks, loss spans marked with ⟦ ⟧, and their packing statistics.
    Needs the tokenizer only: model_name may be a directory that holds nothing else."""
    tokenizer = train.load_tokenizer(cfg)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    blocks = train.PackedBlocks(cfg, tokenizer, "train", rank, world_size, epochs=1)
    shown, tokens, loss_tokens, counts = [], 0, 0, {}
    for block in blocks:
        if len(shown) == n:
            break
        counts = block["position"].counts_at_end
        if "input_ids" not in block:  # the stream's end
            continue
        shown.append(block)
        tokens, loss_tokens = tokens + block["tokens"], loss_tokens + block["loss_tokens"]
        bounds = block["cu_seqlens"].tolist()
        print(
            f"=== block {len(shown) - 1}: {len(bounds) - 1} segments, {block['tokens']} tokens, "
            f"{block['loss_tokens']} loss tokens, max segment {block['max_length']}"
        )
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            ids, labels = block["input_ids"][0, a:b].tolist(), block["labels"][0, a:b].tolist()
            kind = "padding" if a >= block["tokens"] else "conversation"
            print(f"--- segment {s} ({kind}): tokens {a}..{b - 1}, positions 0..{b - a - 1}")
            if kind == "conversation":
                print(mark_loss_spans(tokenizer, ids, labels))
    capacity = max(1, len(shown) * cfg.max_seq_len)
    print(
        f"=== {len(shown)} blocks: non-padding {tokens / capacity:.1%}, loss tokens {loss_tokens / capacity:.1%}, "
        f"conversations {counts.get('conversations', 0)} (+{counts.get(train.EXTRA_SAMPLES, 0)} samples for earlier "
        f"reasoning turns), truncated {counts.get('truncated', 0)}, "
        f"skipped {train.skip_reasons(counts)}"
    )
    if by_source := train.by_source(counts, cfg):  # several sources: each one's counts
        print(f"=== by source: {json.dumps(by_source)}")
    if out_path:
        keys = ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_idx")
        Path(out_path).write_text("".join(json.dumps({k: b[k].tolist() for k in keys}) + "\n" for b in shown))


def mark_loss_spans(tokenizer, ids: list[int], labels: list[int]) -> str:
    """Decoded text with every run of loss tokens wrapped in ⟦ ⟧."""
    runs = itertools.groupby(zip(ids, labels), key=lambda pair: pair[1] != -100)
    text = [(loss, tokenizer.decode([token for token, _ in run])) for loss, run in runs]
    return "".join(f"⟦{t}⟧" if loss else t for loss, t in text)


def main() -> None:
    usage = "inspect_data.py N [--out FILE] [--config FILE] [--KEY VALUE ...]"
    parser = argparse.ArgumentParser(usage=usage, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("n", type=int, help="blocks to show")
    parser.add_argument("--out", default="", metavar="FILE", help="the blocks' signals as JSON lines")
    try:
        cfg, args = train.parse_args(sys.argv[1:], parser)
        train.check_data(cfg, "train")  # a missing, empty or wrong-column file: before the tokenizer
        inspect_blocks(cfg, args.n, args.out)
    except train.UserError as e:  # as train.py: one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
