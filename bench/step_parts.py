#!/usr/bin/env python3
"""Where a step's time and memory go, part by part, on one GPU (issue 25, targets 2 and 3): the measurements that
choose the next lever before it goes into train.py. docs/BENCHMARKS.md has what they gave.

  sublayers --model-config DIR --tokenizer DIR --data FILE --seq-len N --out FILE
      a 2-layer model of the geometry (one Gated DeltaNet layer, one gated full-attention layer), bf16, compiled as
      the recipe compiles it, one packed block of the real data: each layer's forward + backward time, what its
      forward leaves allocated for backward, and its peak, with nothing recomputed, the whole layer recomputed, its
      token mixer only (Gated DeltaNet or attention), its MLP only
  head --seq-len N --loss-fraction F
      the LM head and its loss on F * N loss tokens (the geometry's 248,320 x 5,120 head): train.HeadLoss with
      train.softmax_gradient eager and compiled (as build_model compiles it), time and peak
  softmax --rows N
      train.softmax_gradient on one chunk of N rows of the geometry's 248,320-entry logits (bf16), compiled as
      build_model compiles it, against a form through log_softmax (a max-and-sum pass, then the write),
      each also with Inductor's coordinate-descent tuning: compile time, ms, TB/s over two reads and one write of
      the logits, and the largest difference from the eager fp32 computation
  adamw --model-config DIR
      one optimizer step over tensors of the geometry's trained parameters (fp32, on the GPU): clip_grad_norm_ then
      fused AdamW, against the norm alone with the clipping folded into fused AdamW's grad_scale
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import train  # noqa: E402


def timed(fn, repeat: int = 3):
    """fn()'s last run: (its result, ms by CUDA events, peak bytes over what was allocated before)."""
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
    return out, start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def cmd_sublayers(args) -> None:
    from bench import two_layer_model

    model, block = two_layer_model(args)  # as bench.py layers builds it
    train.compile_elementwise(model.model.layers)
    inputs = train.packed_inputs(block)
    layers = model.model.layers
    # Each layer alone, forward + backward of its output's sum, under four recomputation choices; its arguments as
    # the model's forward gave them.
    calls = {}
    grab = [
        layer.register_forward_pre_hook(lambda m, a, k: calls.setdefault(m, (a, k)), with_kwargs=True)
        for layer in layers
    ]
    with torch.no_grad():
        model.model(**inputs)
    for h in grab:
        h.remove()
    checkpoint = torch.utils.checkpoint.checkpoint
    variants = []
    for layer in layers:
        mixer_name = "linear_attn" if layer.block_type == "linear_attention" else "self_attn"
        plain = {"mixer": getattr(layer, mixer_name), "mlp": layer.mlp}
        for choice in ("none", "layer", "mixer", "mlp"):
            setattr(layer, mixer_name, Checkpointed(plain["mixer"]) if choice == "mixer" else plain["mixer"])
            layer.mlp = Checkpointed(plain["mlp"]) if choice == "mlp" else plain["mlp"]

            def run(layer=layer, choice=choice):
                (hidden, *rest), kwargs = calls[layer]
                x = torch.randn_like(hidden).requires_grad_()
                call = (lambda *a, **k: checkpoint(layer, *a, use_reentrant=False, **k)) if choice == "layer" else layer
                out = call(x, *rest, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                kept = torch.cuda.memory_allocated()
                out.float().sum().backward()
                return kept

            before_forward = torch.cuda.memory_allocated()
            kept, ms, peak = timed(run)
            row = {
                "layer": layer.block_type,
                "recomputed": choice,
                "kept_after_forward_mib": (kept - before_forward) / 2**20,
                "peak_mib": peak / 2**20,
                "fwd_bwd_ms": ms,
            }
            variants.append(row)
            print("bench sublayers:", json.dumps(row), flush=True)
        setattr(layer, mixer_name, plain["mixer"])
        layer.mlp = plain["mlp"]
    summary = {"seq_len": args.seq_len, "loss_tokens": block["loss_tokens"], "variants": variants}
    Path(args.out).write_text(json.dumps(summary, indent=1))


class Checkpointed(torch.nn.Module):  # a part recomputed in backward: only its inputs are kept
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def cmd_head(args) -> None:
    device, vocab, hidden_size = torch.device("cuda"), 248320, 5120
    n = int(args.seq_len * args.loss_fraction)
    torch.manual_seed(0)
    hidden = torch.randn(n, hidden_size, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device=device) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device=device)
    compiled = torch.compile(train.softmax_gradient, dynamic=True)  # as build_model compiles it
    reference = None
    for chunk in (4096, 8192):
        for name, loss_fn in (("eager", train.softmax_gradient), ("compiled", compiled)):
            run = partial(train.HeadLoss.forward, _Ctx(), hidden, weight, targets, chunk, 1.0, loss_fn)
            losses, ms, peak = timed(run)
            reference = losses if reference is None else reference
            row = {
                "chunk": chunk,
                "softmax_gradient": name,
                "loss_tokens": n,
                "ms": ms,
                "peak_gib": peak / 2**30,
                "max_loss_diff": (losses - reference).abs().max().item(),
            }
            print("bench head:", json.dumps(row), flush=True)


def softmax_gradient_via_log_softmax(logits: torch.Tensor, targets: torch.Tensor):  # the candidate form
    log_p = logits.float().log_softmax(dim=1)
    p, hit = log_p.exp(), torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    return -log_p.gather(1, targets[:, None]).squeeze(1), torch.where(hit, p - 1, p).to(logits.dtype)


def cmd_softmax(args) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, 248320, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, 248320, (args.rows,), device="cuda")
    ref_loss, ref_grad = train.softmax_gradient(logits, targets)  # eager: fp32 throughout, then the bf16 cast
    for name, fn in (("recipe", train.softmax_gradient), ("log_softmax", softmax_gradient_via_log_softmax)):
        for tuned in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(fn, dynamic=True, options={"coordinate_descent_tuning": tuned})
            t0 = time.perf_counter()
            compiled(logits, targets)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            (loss, grad), ms, peak = timed(partial(compiled, logits, targets), repeat=10)
            row = {
                "form": name,
                "coordinate_descent_tuning": tuned,
                "rows": args.rows,
                "compile_s": round(compile_s, 1),
                "ms": round(ms, 3),
                "tb_per_s_3_passes": round(3 * logits.numel() * 2 / ms / 1e9, 2),
                "peak_gib": round(peak / 2**30, 2),
                "max_loss_diff": (loss - ref_loss).abs().max().item(),
                "max_grad_diff": (grad.float() - ref_grad.float()).abs().max().item(),
            }
            print("bench softmax:", json.dumps(row), flush=True)


class _Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def cmd_adamw(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_config).get_text_config()
    config.use_cache = False
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = [p.shape for p in meta.parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"bench adamw: {n / 1e9:.2f} B parameters, {len(params)} tensors", flush=True)
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    optimizer.step()  # the state exists
    grads = [p.grad for p in params]

    def clip_then_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def norm_into_step():
        norm = torch.nn.utils.get_total_norm(grads)
        optimizer.grad_scale = ((norm + 1e-6) / 1.0).clamp(min=1.0)  # as train_step sets it
        optimizer.step()
        del optimizer.grad_scale

    def step_only():
        optimizer.step()

    def norm_only():
        torch.nn.utils.get_total_norm(grads)

    for name, fn in (
        ("clip_grad_norm_ + fused AdamW", clip_then_step),
        ("norm, clipping as fused AdamW's grad_scale", norm_into_step),
        ("fused AdamW alone", step_only),
        ("gradient norm alone", norm_only),
    ):
        _, ms, _ = timed(fn, repeat=5)
        bytes_moved = 28 * n  # AdamW: read p, g, m, v; write p, m, v (fp32)
        print(
            "bench adamw:",
            json.dumps({"variant": name, "ms": ms, "adamw_tb_per_s": bytes_moved / ms / 1e9}),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sublayers")
    p.add_argument("--model-config", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--attn", default="torch_varlen")
    p.add_argument("--out", required=True)
    p = sub.add_parser("head")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--loss-fraction", type=float, default=0.62)
    p = sub.add_parser("softmax")
    p.add_argument("--rows", type=int, default=4096)
    p = sub.add_parser("adamw")
    p.add_argument("--model-config", required=True)
    args = parser.parse_args()
    t0 = time.perf_counter()
    {"sublayers": cmd_sublayers, "head": cmd_head, "softmax": cmd_softmax, "adamw": cmd_adamw}[args.cmd](args)
    print(f"bench {args.cmd}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
