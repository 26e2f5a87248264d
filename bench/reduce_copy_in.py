"""BENCH: FSDP2's copy of a module's gradients into its reduce-scatter input (torch._chunk_cat: bf16 gradients cast
into one fp32 buffer, laid out rank by rank), against a plain copy a tensor, for the geometry's FSDP units (the root:
embedding, final norm and LM head; a Gated DeltaNet layer; a full-attention layer), on one rank and as on 8.

    python3 bench/reduce_copy_in.py [--model-config bench/configs/qwen3.8-27b-geometry-8layers] [--reps 20]

Prints one line per unit and rank count: ms and TB/s (bf16 read, fp32 written) of each, and whether both wrote the
same buffer; then a plain bf16 -> fp32 copy's rate. docs/BENCHMARKS.md, twenty-ninth round: on one H100 and one H200
(a first form of this script) the root's one-rank chunk_cat took ten times the copies' time, yet in train.py's step
the copies gained 0.1%."""

import argparse
from functools import partial

import torch
from adamw_kernels import timed  # bench/: run on the GPU alone, ms a call


def units(model_config: str) -> dict:  # FSDP unit -> its trained parameters' shapes, as train.py shards them
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        unit = f"layer {parts[parts.index('layers') + 1]}" if "layers" in parts else "root"
        shapes.setdefault(unit, []).append(tuple(p.shape))
    kinds = getattr(config.get_text_config(), "layer_types", None) or ["full_attention"] * len(shapes)
    first = {kind: f"layer {kinds.index(kind)}" for kind in dict.fromkeys(kinds)}  # one layer of each kind
    return {"root": shapes["root"], **{f"{unit} ({kind})": shapes[unit] for kind, unit in first.items()}}


def copy_in_by_copies(grads: list, out: torch.Tensor, ranks: int) -> None:
    """torch._chunk_cat(grads, 0, ranks, out=out.view(ranks, -1))'s result, one copy a tensor and rank: each rank's
    rows of each tensor in turn, the last rank's padded with zeros."""
    out, offset = out.view(ranks, -1), 0
    for grad in grads:
        rows, flat = -(-grad.shape[0] // ranks), grad.view(grad.shape[0], -1)
        for rank in range(ranks):
            into, taken = out[rank, offset : offset + rows * flat.shape[1]].view(rows, -1), flat[rank * rows :][:rows]
            into[: len(taken)].copy_(taken)
            into[len(taken) :].zero_()
        offset += rows * flat.shape[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", default="bench/configs/qwen3.8-27b-geometry-8layers")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    for unit, shapes in units(args.model_config).items():
        grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        for ranks in (1, 8):
            numel = sum(-(-g.shape[0] // ranks) * ranks * g[0].numel() for g in grads)
            fsdp, ours = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
            chunk_cat = partial(torch._chunk_cat, grads, 0, ranks, out=fsdp.view(ranks, -1))
            chunk_cat_ms, copies_ms = (
                timed(chunk_cat, args.reps),
                timed(partial(copy_in_by_copies, grads, ours, ranks), args.reps),
            )
            tb = (sum(g.numel() for g in grads) * 2 + numel * 4) / 1e9
            line = f"chunk_cat {chunk_cat_ms:6.2f} ms ({tb / chunk_cat_ms:4.2f} TB/s), copies {copies_ms:6.2f} ms"
            line += f" ({tb / copies_ms:4.2f} TB/s), the same buffer: {torch.equal(fsdp, ours)}"
            print(f"copy-in: {unit:26s} {ranks} rank(s): {line}", flush=True)
        torch.cuda.empty_cache()
    x, y = torch.empty(2**30, device="cuda", dtype=torch.bfloat16), torch.empty(2**30, device="cuda")
    ms = timed(lambda: y.copy_(x), args.reps)
    print(f"copy-in: a bf16 -> fp32 copy of 2**30 elements: {ms:.2f} ms ({6 * 2**30 / 1e9 / ms:.2f} TB/s)")


if __name__ == "__main__":
    main()
