"""The fill of the recipe's packed blocks over a stream, with each pack buffer's emptiest block carried into the next
buffer (train.py's PackedBlocks) and without (each buffer's emptiest block yielded last instead): what reaches the
GPU. On CPU, through PackedBlocks itself; the chat template renders each distinct conversation once (memoised).

    python bench/pack_fill.py DATA.jsonl TOKENIZER_DIR [BLOCK_LEN ...]

DATA: e.g. the bench's copies (python bench/bench.py data .bench-assets/ultrachat_200.jsonl /tmp/x40.jsonl --copies 40);
TOKENIZER_DIR: .bench-assets/tok (the Qwen3.5 tokenizer and chat template). Defaults: 16384 32768.
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

data, tokenizer_dir, *lengths = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
render, memo = train.AssistantMasker.samples, {}


def samples(self, messages, tools=None):
    key = json.dumps([messages, tools], sort_keys=True, default=str)
    if key not in memo:
        memo[key] = render(self, messages, tools)
    return memo[key]


train.AssistantMasker.samples = samples
pack = train.PackedBlocks._pack


def without_carry(self, *args, carry):
    return (yield from pack(self, *args, carry=False))


print(f"{'block':>6} {'carry':>5} {'blocks':>6} {'mean fill':>9} {'min fill (not the last)':>23} {'blocks < 50%':>12}")
for block_len in map(int, lengths or [16384, 32768]):
    for carry in (True, False):
        train.PackedBlocks._pack = pack if carry else without_carry
        cfg = train.Config(dataset_name=data, max_seq_len=block_len)  # pack_buffer_blocks: the default
        blocks = [b for b in train.PackedBlocks(cfg, tokenizer, "train", 0, 1, epochs=1) if "input_ids" in b]
        fills = [b["tokens"] / block_len for b in blocks]
        sparse = sum(f < 0.5 for f in fills)
        mean, low = sum(fills) / len(fills), min(fills[:-1])
        print(f"{block_len:>6} {str(carry):>5} {len(blocks):>6} {mean:>9.2%} {low:>23.2%} {sparse:>12}")
