#!/usr/bin/env python3
"""Writes a tiny, randomly initialised chat model to a directory, for the CPU smoke run and the tests.

No hub access: the tokenizer is a byte-level BPE trained on the bundled sample conversations, with the special
tokens of ChatML and Llama-3 templates, and the real Qwen3.5 chat template (examples/qwen3_5_chat_template.jinja,
Apache-2.0, from the Qwen3.5 tokenizer). The model is a 2-layer Qwen3 (dense) or, with --hybrid, a 4-layer
qwen3_5 (3 Gated DeltaNet layers and 1 full-attention layer, image-text layout like the real checkpoint).

    python tools/make_tiny_model.py .tiny-model
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added but not special, as in Qwen's tokenizer


def make_tokenizer(vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [m["content"] for line in open(ROOT / "data/ultrachat_sample.jsonl") for m in json.loads(line)["messages"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens(ADDED)
    tok.chat_template = (ROOT / "examples/qwen3_5_chat_template.jinja").read_text()
    return tok


def make_model(vocab_size: int, hybrid: bool = False, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3_5Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    if not hybrid:
        return AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=2, **common))
    text = dict(
        num_hidden_layers=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **common,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return AutoModelForImageTextToText.from_config(config)


def write_tiny_model(out: str | Path, hybrid: bool = False) -> Path:
    out = Path(out)
    tok = make_tokenizer()
    model = make_model(len(tok), hybrid)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--hybrid", action="store_true")
    args = parser.parse_args()
    print(f"wrote {write_tiny_model(args.out, args.hybrid)}")
