#!/usr/bin/env python3
"""The counting pass's cost per conversation (issue 25, target 5): this rank's shard of DATA packed into blocks as
train.py packs it (block_loader, the real chat template and masker), without a model, for each num_workers given:
as the counting pass does (counted in its workers, only each stream's end handed over), and as the training stream
does (every block handed over). On CPU; its figure times the conversations a rank holds is the pass's time.

    python bench/counting_time.py DATA TOKENIZER_DIR [--seq-len 32768] [--workers 0 1 2]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("tokenizer")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    records = sum(1 for line in open(args.data) if line.strip())
    for workers in args.workers:
        cfg = train.Config(
            model_name="unused",
            tokenizer_name=args.tokenizer,
            dataset_name=args.data,
            max_seq_len=args.seq_len,
            num_workers=workers,
            eval_fraction=0.0,
        )
        tokenizer = train.load_tokenizer(cfg)
        for counting in (True, False):
            t0 = time.perf_counter()
            loader = train.block_loader(cfg, tokenizer, "train", 0, 1, 1, report=False, counting=counting)
            items = list(loader)
            blocks = sum(item["blocks"] for item in items) if counting else sum("input_ids" in i for i in items)
            seconds, kind = time.perf_counter() - t0, "counting pass" if counting else "training stream"
            print(
                f"num_workers {workers}, {kind}: {records} conversations into {blocks} blocks of {args.seq_len} "
                f"in {seconds:.1f} s, {1e3 * seconds / records:.2f} ms per conversation",
                flush=True,
            )


if __name__ == "__main__":
    main()
