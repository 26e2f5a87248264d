#!/usr/bin/env python3
"""A third recipe in the throughput benchmark: TRL's SFTTrainer (TRL 1.16), unmodified, on the same job as ours and
the seed's: the same geometry (random weights created on the GPU, seed 0), tokenizer, data, block length and steps.

Subcommands (bench/run_bench.sh runs `run` for BENCH_KINDS="... trl"):
  run --model-config DIR --tokenizer DIR --data FILE --seq-len N --steps N --out DIR
                            SFTTrainer with its best settings for this job (TRL_SETTINGS); writes OUT/metrics.jsonl in
                            the schema of train.py's MetricsLog, so that `bench.py summary` and `bench.py steps` read
                            it as they read ours. python3 on one GPU; under torchrun, Trainer's DDP over several.
  check                     on a tiny qwen3_5 (tools/make_tiny_model.py), the logits of TRL's packed, padding-free
                            batch of two conversations against each conversation alone, with TRL's signals and with
                            some of them taken away: which of full attention, the Gated DeltaNet recurrence and its
                            causal conv keep the conversations apart. Any device: on the GPU with fla's and
                            causal-conv1d's kernels; on CPU, where transformers' torch fallbacks refuse packed signals,
                            with those kernels emulated (their torch references run per conversation).

What TRL feeds the model (its DataCollatorForLanguageModeling, padding_free=True): input_ids, labels (-100 on each
conversation's first token), position_ids (restarting per conversation), cu_seq_lens_q/k, max_length_q/k and seq_idx,
as ours does. transformers 5.23 hands cu_seq_lens_q to fla's chunk_gated_delta_rule and seq_idx to causal-conv1d, and
attention gets cu_seq_lens (torch_varlen) or a block-diagonal mask derived from position_ids (sdpa, no attention_mask).
Lines `bench: trl limitation: ...` name what a run could not keep apart (none is expected on the GPU machine).

Steady state as bench.py: steps 1 and 2 are warm-up, the summary averages the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # train (attention, FLOP counts); bench (bench/, the script's directory) comes first
sys.path.append(str(ROOT / "tools"))  # make_tiny_model, for check

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import bench  # noqa: E402

# The settings given to TRL, and why (the rest are TRL's defaults): one packed block per step as ours, the assistant
# turns' loss, every layer recomputed, bf16 autocast, ours' optimiser, schedule and seed, nothing but training.
TRL_SETTINGS = dict(
    packing=True,
    packing_strategy="bfd",  # best-fit decreasing over the whole dataset, conversations kept whole (longer: cut)
    padding_free=True,  # one row of real tokens with cu_seq_lens, seq_idx and position_ids: no padding, no mask
    per_device_train_batch_size=1,
    gradient_accumulation_steps=1,
    # The Qwen3.5 template has no {% generation %} tags: TRL 1.16 swaps in its own training copy of it
    # (chat_templates/qwen3_5_think_training.jinja, the same render with the tags and an empty <think></think> in
    # every assistant turn) and masks all but the assistant turns, their end-of-turn token included.
    assistant_only_loss=True,
    gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False},
    bf16=True,
    learning_rate=1e-5,  # ours: peak 1e-5 after 10 warmup steps, cosine decay, AdamW betas (0.9, 0.95), no decay
    warmup_steps=10,
    lr_scheduler_type="cosine",
    adam_beta1=0.9,
    adam_beta2=0.95,
    weight_decay=0.0,
    max_grad_norm=1.0,
    seed=0,
    logging_steps=1,
    save_strategy="no",
    eval_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


def resolve_attention(name: str, device: torch.device) -> str:
    """torch_varlen (train.py's, PyTorch's varlen flash kernel: no flash-attn on the GPU machine) reads TRL's
    cu_seq_lens_q and max_length_q; sdpa gets a block-diagonal mask that transformers derives from position_ids."""
    import train

    return train.resolve_attention(name, device)


def build_model(config, attn: str, dtype, device, seed: int = 0):
    """The geometry's random weights on the device, as bench.py's seed does: from_config under torch.device. The
    image-text class for an image-text config (the real checkpoint's, which TRL's own loading picks), its vision
    tower frozen as ours freezes it (no optimizer state for it; DDP would wait for its gradients otherwise)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config.use_cache = config.get_text_config().use_cache = False  # TRL passes use_cache=False too
    image_text = type(config) in AutoModelForImageTextToText._model_mapping
    model_class = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class.from_config(config, attn_implementation=attn, dtype=dtype)
    trained = {id(p) for p in model.get_decoder().parameters()} | {id(model.get_output_embeddings().weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)
    return model


def packed_signals(model, batch: dict) -> tuple[list[str], list[str]]:
    """(what keeps the conversations apart, what does not) for this model and one of TRL's batches, by layer kind."""
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    attn = model.config._attn_implementation
    apart, mixed = [], []
    if attn in ("sdpa", "eager"):
        ok = "position_ids" in batch and batch.get("attention_mask") is None
        (apart if ok else mixed).append(f"full attention ({attn}: block-diagonal mask from position_ids)")
    else:
        ok = "cu_seq_lens_q" in batch
        (apart if ok else mixed).append(f"full attention ({attn}: cu_seq_lens_q)")
    if "linear_attention" in kinds:
        fla = importlib.util.find_spec("fla") is not None
        conv = importlib.util.find_spec("causal_conv1d") is not None
        ok = fla and "cu_seq_lens_q" in batch
        (apart if ok else mixed).append("Gated DeltaNet recurrence (fla chunk_gated_delta_rule, cu_seqlens)")
        ok = conv and "seq_idx" in batch
        (apart if ok else mixed).append("Gated DeltaNet causal conv (causal-conv1d, seq_idx)")
    return apart, mixed


class StepMetrics(TrainerCallback):
    """A TrainerCallback: per step, wall time (CUDA synchronised at the step's end), the block's tokens (padding-free:
    all real) and loss tokens (labels shifted, as TRL's loss), tokens/s/GPU, peak memory; one metrics.jsonl line per
    step in train.py's MetricsLog schema (the loss, lr and grad norm from Trainer's log of that step)."""

    def __init__(self, out: Path, seq_len: int, total_steps: int):
        self.out, self.seq_len, self.total_steps = out, seq_len, total_steps
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.window, self.record, self.reported = [0, 0, 0], None, False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import train

        self.cuda = torch.cuda.is_available()
        self.n_matmul, self.attn_per_sq = train.matmul_params(model), train.attention_flops_per_sq_token(model)
        name = torch.cuda.get_device_name() if self.cuda else ""
        self.peak = next((v for k, v in train.PEAK_BF16_FLOPS.items() if k in name), None)
        model.register_forward_pre_hook(self.count, with_kwargs=True)
        self.start = self.since = time.perf_counter()
        if self.rank == 0:
            print(f"bench: trl world_size {self.world}", flush=True)

    def count(self, module, args, kwargs):  # the top-level forward, once per step (recomputation is per layer)
        if not module.training or "labels" not in kwargs:
            return
        ids, labels, cu = kwargs["input_ids"], kwargs["labels"], kwargs.get("cu_seq_lens_q")
        self.window[0] += ids.numel()
        self.window[1] += (labels[:, 1:] != -100).sum()  # a tensor: read at the step's end, after the sync
        self.window[2] += (cu.diff().long() ** 2).sum() if cu is not None else ids.numel() ** 2  # attention FLOPs
        if not self.reported and self.rank == 0:
            self.reported = True
            shown = {k: tuple(v.shape) if hasattr(v, "shape") else v for k, v in kwargs.items() if k != "labels"}
            print(f"bench: trl batch {shown}", flush=True)
            apart, mixed = packed_signals(module, kwargs)
            print(f"bench: trl block-diagonal: {'; '.join(apart) or 'nothing'}", flush=True)
            for what in mixed:
                print(f"bench: trl limitation: {what} is not kept apart: packed conversations mix", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        counts = torch.tensor([float(c) for c in self.window], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            counts = counts.to("cuda" if self.cuda else "cpu")
            torch.distributed.all_reduce(counts)
        tokens, loss_tokens, sum_sq = counts.tolist()
        seconds, ranks = now - self.since, self.world
        flops = 6 * self.n_matmul * tokens + self.attn_per_sq * sum_sq
        self.record = {
            "step": state.global_step,
            "total_steps": self.total_steps,
            "tokens_per_s_per_gpu": tokens / seconds / ranks,
            "loss_tokens_per_s_per_gpu": loss_tokens / seconds / ranks,
            "non_padding_fraction": tokens / (self.seq_len * ranks),  # a block is at most max_length real tokens
            "loss_token_fraction": loss_tokens / (self.seq_len * ranks),
            "mfu": flops / seconds / ranks / self.peak if self.peak else None,
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else bench_rss_gib(),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0,
            "tokens": int(tokens),
            "loss_tokens": int(loss_tokens),
            "s_step": seconds,
            "elapsed_s": now - self.start,
            "time": time.time(),
        }
        self.since, self.window = now, [0, 0, 0]

    def on_log(self, args, state, control, logs=None, **kwargs):  # right after on_step_end, in the same step
        if self.record is None or "loss" not in (logs or {}) or self.rank != 0:
            return
        r = self.record | {"loss": logs["loss"], "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm")}
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(
            f"step {r['step']}/{r['total_steps']} | loss {r['loss']:.4f} | {r['tokens']} tokens, "
            f"{r['loss_tokens']} loss tokens | {r['s_step']:.3f} s | {r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu | "
            f"mfu {mfu} | mem {r['memory_gib']:.1f} GiB",
            flush=True,
        )
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        self.record = None


def bench_rss_gib() -> float:  # on CPU (smoke runs): the process's peak resident memory
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cmd_run(args) -> None:
    from datasets import load_dataset
    from transformers import AutoConfig, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    bench.lift_fla_hopper_guard()  # timing only, as for ours and the seed (bench.py)
    rank, out = int(os.environ.get("RANK", "0")), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(bench.build_device())
    attn = resolve_attention(args.attn, device)
    config = AutoConfig.from_pretrained(args.model_config)
    if args.full_attention_only:  # CPU smoke runs: transformers' torch fallbacks refuse packed signals (see check)
        text = config.get_text_config()
        text.layer_types = ["full_attention"] * text.num_hidden_layers
    t0 = time.perf_counter()
    model = build_model(config, attn, getattr(torch, args.weights), device)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"bench: trl random init in {time.perf_counter() - t0:.1f}s ({params / 1e9:.2f}B, {args.weights})")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    data = load_dataset("json", data_files=args.data, split="train")
    settings = TRL_SETTINGS | dict(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        max_length=args.seq_len,
        dataset_num_proc=args.dataset_num_proc or None,  # tokenizing and packing: before step 1, not timed
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=not args.keep_activations,
    )
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**settings),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepMetrics(out, args.seq_len, args.steps)],
    )
    if rank == 0:
        packed = trainer.train_dataset
        lengths = [n for row in packed["seq_lengths"] for n in row]
        fill = sum(lengths) / (len(packed) * args.seq_len)
        cut = sum(n == args.seq_len for n in lengths)  # bfd truncates a longer conversation to max_length
        template = "TRL's training template" if trainer.chat_template else "the tokenizer's template"
        print(
            f"bench: trl data: {len(lengths)} conversations in {len(packed)} packed rows (mean fill {fill:.1%}), "
            f"{cut} cut at {args.seq_len} tokens; assistant-only loss with {template}",
            flush=True,
        )
    result = trainer.train()
    if rank == 0:
        print(f"bench: trl done {json.dumps({'steps': result.global_step, 'train_loss': result.training_loss})}")


# ------------------------------------------------------------------------------------------------------------
# check: are TRL's packed batches block-diagonal?
# ------------------------------------------------------------------------------------------------------------

# What each variant of TRL's batch keeps: all of it, or with signals taken away (what a collator that gives
# position_ids only would feed, and which layer kind depends on which signal).
VARIANTS = {
    "TRL's batch": None,
    "without seq_idx": {"seq_idx"},
    "without cu_seq_lens": {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"},
    "position_ids only": {"seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"},
    "input_ids only": {"position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"},
}  # the last: nothing tells the conversations apart, so every layer kind mixes them (the check's own check)


@contextlib.contextmanager
def emulated_kernels():
    """For CPU checks: transformers' Gated DeltaNet calls, instead of fla's chunk_gated_delta_rule and causal-conv1d's
    causal_conv1d_fn (CUDA only), their torch references run once per conversation (by cu_seqlens and seq_idx), which
    is what those kernels compute. It checks that TRL's signals reach the kernels and mean there what they must; not
    the kernels themselves (ours relies on them alike), which a check on the GPU does."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    conv, rule = (inspect.unwrap(f) for f in (qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule))

    def conv_per_segment(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):  # x: [1, channels, T]
        if seq_idx is None:
            return conv(x, weight, bias, activation)
        starts = [0, *((seq_idx[0, 1:] != seq_idx[0, :-1]).nonzero().flatten() + 1).tolist(), x.shape[-1]]
        return torch.cat([conv(x[..., a:b], weight, bias, activation) for a, b in zip(starts, starts[1:])], dim=-1)

    def rule_per_segment(query, key, value, g, beta, cu_seqlens=None, **kwargs):  # [1, T, heads, dim]
        if cu_seqlens is None:
            return rule(query, key, value, g=g, beta=beta, **kwargs)
        bounds = cu_seqlens.tolist()
        spans = zip(bounds, bounds[1:])
        out = [
            rule(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kwargs)[0]
            for a, b in spans
        ]
        return torch.cat(out, dim=1), None

    saved = qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule
    qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule = conv_per_segment, rule_per_segment
    try:
        yield
    finally:
        qwen3_5.causal_conv1d_fn, qwen3_5.torch_chunk_gated_delta_rule = saved


def on(device, batch: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def forward_alone(model, collator, ids: list[int], device) -> torch.Tensor:
    """One conversation's logits, collated alone by TRL; where a torch fallback refuses even one sequence's
    cu_seq_lens and seq_idx (no-ops there), with input_ids and position_ids only."""
    one = on(device, collator([{"input_ids": ids}]))
    try:
        return model(**{k: v for k, v in one.items() if k != "labels"}, use_cache=False).logits
    except ValueError:
        return model(input_ids=one["input_ids"], position_ids=one["position_ids"], use_cache=False).logits


def cmd_check(args) -> None:
    """Two conversations of data/ultrachat_sample.jsonl, tokenized and packed into one row by TRL (SFTTrainer's own
    dataset preparation: assistant-only, bfd) and collated by its padding-free collator; the model's logits over each
    conversation in that row against the same conversation run alone. The first conversation can differ only by
    rounding (attention is causal); the second differs where something leaks across the boundary."""
    import make_tiny_model
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    device = torch.device(args.device or bench.build_device())
    attn = resolve_attention(args.attn, device)
    dtype = torch.bfloat16 if attn == "torch_varlen" else torch.float32  # the varlen flash kernel: bf16 only
    tolerance = 0.1 if dtype == torch.bfloat16 else 1e-4
    tok = make_tiny_model.make_tokenizer()
    lines = (ROOT / "data" / "ultrachat_sample.jsonl").read_text().splitlines()[:2]
    records = Dataset.from_list([{"messages": json.loads(line)["messages"][:2]} for line in lines])
    hybrid = make_tiny_model.make_model(len(tok), hybrid=True).config
    layers = hybrid.text_config.layer_types
    cases = [("hybrid", layers, contextlib.nullcontext)]
    if not all(importlib.util.find_spec(m) for m in ("fla", "causal_conv1d")):  # the fallbacks refuse TRL's batch
        cases.append(("hybrid, emulated kernels", layers, emulated_kernels))
    cases.append(("full attention only", ["full_attention"] * len(layers), contextlib.nullcontext))
    results = []
    for name, kinds, context in cases:
        config = hybrid.__class__.from_dict(hybrid.to_dict())
        config.text_config.layer_types = list(kinds)
        # Weights larger than the default 0.02: a leak then moves the logits far above rounding
        config.initializer_range = config.text_config.initializer_range = args.init_std
        model = build_model(config, attn, dtype, device).eval()
        with tempfile.TemporaryDirectory() as tmp:
            settings = TRL_SETTINGS | dict(output_dir=tmp, max_length=4096, use_cpu=device.type == "cpu")
            trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=records, processing_class=tok)
        row = trainer.train_dataset[0]
        assert len(row["seq_lengths"]) == 2, "both conversations in one packed row"
        batch = on(device, trainer.data_collator([row]))
        bounds = batch["cu_seq_lens_q"].tolist()
        spans = list(zip(bounds, bounds[1:]))
        if name == "hybrid":
            shapes = ", ".join(f"{k} {list(v.shape) if isinstance(v, torch.Tensor) else v}" for k, v in batch.items())
            print(f"check: TRL's batch: {shapes}; cu_seq_lens_q {bounds}")
        with torch.no_grad(), context():
            alone = [forward_alone(model, trainer.data_collator, row["input_ids"][a:b], device) for a, b in spans]
            for variant, dropped in VARIANTS.items():
                inputs = {k: v for k, v in batch.items() if k != "labels" and k not in (dropped or ())}
                try:
                    logits = model(**inputs, use_cache=False).logits
                except Exception as e:  # the torch fallbacks refuse packed signals; varlen attention needs them
                    results.append((name, variant, f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                    continue
                first, second = ((logits[:, a:b] - x).abs().max().item() for (a, b), x in zip(spans, alone))
                verdict = "block-diagonal" if second <= max(tolerance, 4 * first) else "CONVERSATIONS MIX"
                diffs = f"max |logit packed - alone|: first {first:.2e}, second {second:.2e}"
                results.append((name, variant, f"{diffs}: {verdict}"))
    for name, variant, result in results:
        print(f"check: {name:25s} {attn:12s} {variant:20s} {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    bench.add_run_arguments(p)
    p.add_argument(
        "--weights",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="bfloat16 (default: the fastest, the seed's) or float32 (TRL's own default: fp32 master, bf16 autocast; "
        "with --attn sdpa only: autocast leaves the rotary q and k in fp32, which the varlen flash kernel refuses)",
    )
    p.add_argument("--dataset-num-proc", type=int, default=8, help="processes tokenizing the data (0: TRL's one)")
    p.add_argument("--full-attention-only", action="store_true", help="CPU smoke runs: no Gated DeltaNet layers")
    p.add_argument("--keep-activations", action="store_true", help="no recomputation (ours keeps layers that fit)")
    p = sub.add_parser("check")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--device", default="", help="default: the GPU if there is one (bench.build_device)")
    p.add_argument("--init-std", type=float, default=0.2)
    args = parser.parse_args()
    {"run": cmd_run, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    main()
