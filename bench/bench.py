#!/usr/bin/env python3
"""Throughput benchmark: the recipe (train.py) against the seed recipe, on the Qwen3.8-27B geometry, random init.

Subcommands (bench/run_bench.sh strings them together; docs/BENCHMARKS.md has the results):
  data SRC OUT --copies N   N shuffled copies of SRC's conversations in one JSONL (the 200 real UltraChat
                            conversations are ~3 blocks of 32k tokens; a benchmark needs more)
  ours --model-config DIR --tokenizer DIR --data FILE --seq-len N --steps N --out DIR
                            under torchrun: train.train(config), the recipe's own code path (packing, FSDP2,
                            loss, loop, metrics.jsonl), with the settings init: random (the geometry's own
                            initialiser, no checkpoint read), save_every: -1 and export: false; --lever NAME
                            adds a step-time lever tried before train.py has it (--help lists them)
  seed SEED_PY              under torchrun: runs the seed script unchanged (runpy, BENCH_* variables from the
                            environment) with a global optimizer-step hook that prints when its first step ends
Both recipes' random weights are created on the GPU; everything after that is each recipe's own.
  summary WORK              reads WORK/runs.tsv (one line per run, written by run_bench.sh), prints the table
                            and writes WORK/summary.json
  flops --model-config DIR  FLOPs per token of the geometry: the recipe's MFU terms and the Gated DeltaNet term
  losses RUN_A RUN_B        two runs' mean loss per window of steps, and their final losses
  steps RUN [RUN ...]       each run's steps (tok/s/GPU, fill, allocator retries) and its mean over the timed steps
                            whose blocks are full
  logsteps LOG --seq-len N  a run's tok/s/GPU and MFU from its log's step lines, ours or TRL's (when metrics.jsonl
                            is missing)
  profile RUN [RUN ...]     a run made with --profile-from, summarised again from its trace: GPU time by kind, the
                            longest kernels, the compute stream's idle gaps and the host calls before each
  packing --tokenizer DIR --data FILE --seq-len N --ranks N
                            on CPU, no model: the recipe's packing of the data, each rank's blocks and their fill

Steady state: steps 1 and 2 are warm-up; averages are over steps >= 3 (the seed's BENCH_WARMUP=2 does the same).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16, as train.PEAK_BF16_FLOPS
GDN_CHUNK = 64  # flash-linear-attention's chunk size for the gated delta rule


def cmd_data(args) -> None:
    lines = [line for line in Path(args.src).read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.copies):
        copy = lines[:]
        rng.shuffle(copy)
        out += copy
    Path(args.out).write_text("\n".join(out) + "\n")
    print(f"wrote {len(out)} conversations ({args.copies} shuffled copies of {len(lines)}) to {args.out}")


def build_device():
    """Where random weights are created: this rank's GPU. On the CPU, random init of this geometry runs at tens
    of millions of parameters a second (single-threaded normal_), minutes per run; neither recipe's real start
    (a checkpoint load) is measured by it, so both recipes' weights are created on the GPU."""
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"


def lift_fla_hopper_guard() -> None:
    """BENCH WORKAROUND (timing only): flash-linear-attention 0.6.0 refuses the gated delta rule's backward on
    Hopper GPUs with Triton >= 3.4, < 3.7.1 (its issue #640: chunk_bwd_dqkwg computes wrong gradients there); the
    H200 image has Triton 3.6. Lifting the refusal runs the same kernels, so step times are representative, but
    the Gated DeltaNet gradients are not to be trusted. Applied to both recipes alike."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except ImportError:
        return
    if chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        if int(os.environ.get("RANK", "0")) == 0:
            print("bench: WORKAROUND fla Hopper/Triton<3.7.1 backward guard lifted (timing only)", flush=True)


def cmd_ours(args) -> None:
    sys.path.insert(0, str(ROOT))
    import yaml

    import train

    lift_fla_hopper_guard()
    if os.environ.get("BENCH_GC") == "off":  # does Python's garbage collector stall steps?
        import gc

        gc.disable()
    if os.environ.get("BENCH_MEMORY_CAP_GIB"):  # e.g. 80: can an 80 GB GPU (H100) take this run?
        import torch

        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(float(os.environ["BENCH_MEMORY_CAP_GIB"]) * 2**30 / total, device)
    config = {
        "model_name": args.model_config,
        "model_revision": "",
        "tokenizer_name": args.tokenizer,
        "dataset_name": args.data,
        "dataset_split": "train",
        "attn_implementation": args.attn,
        "max_seq_len": args.seq_len,
        "max_steps": args.steps,
        "log_every": 1,
        "output_dir": args.out,
        # The recipe's path with random weights (a geometry has config.json only), and nothing written at the end
        # (a 6B-parameter geometry would spend minutes writing 100 GB).
        "init": "random",
        "save_every": -1,
        "export": False,
    }
    overrides = {}
    for setting in args.set:  # the recipe's own settings, as the command line would give them
        key, _, value = setting.partition("=")
        overrides[key] = yaml.safe_load(value)
    if args.mlp_tiles and str(overrides.get("activation_checkpointing", "auto")) == "auto":
        # auto's probe would measure the layers' recomputation tiled, then keep layers that run untiled
        sys.exit("bench: --mlp-tiles needs --set activation_checkpointing=SHARE (auto would measure tiled layers)")
    if args.mlp_tiles or args.saved_on_host_mib:  # levers for long blocks (bench/long_levers.py)
        from long_levers import SavedOnHost, on_each_built_model, tile_mlps

        if args.mlp_tiles:
            on_each_built_model(lambda layers: tile_mlps(layers, args.mlp_tiles))
        if args.saved_on_host_mib:
            on_each_built_model(lambda layers: SavedOnHost(layers, args.saved_on_host_mib << 20))
    train.make_optimizer = with_optimizer_levers(train.make_optimizer, args.lever, args.adamw_streams)
    for lever in [lever for lever in args.lever if lever in STEP_LEVERS]:  # tried before train.py has them
        from long_levers import on_each_built_model

        on_each_built_model(STEP_LEVERS[lever])
    hooks = [free_saved_shards(args.out)] if args.free_saved_shards else []
    hooks += [profile_two_steps(args.profile_from, Path(args.out))] if args.profile_from else []
    hooks += [memory_outside_torch()] if os.environ.get("BENCH_MEMINFO") else []  # (eighteenth round)

    def hook(step, model, loss_sum, blocks):
        for each in hooks:
            each(step, model, loss_sum, blocks)

    result = train.train(train.load_config(("bench", config), ("--set", overrides)), step_hook=hook)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"bench: ours done {json.dumps(result)}", flush=True)


def memory_outside_torch():
    """BENCH (BENCH_MEMINFO=1): a step hook printing the GPU memory held outside PyTorch's allocator (total - free -
    reserved: the CUDA context, loaded kernels, their local memory, NCCL), which auto's room cannot use, and CUDA's
    stack limit, which sizes the local memory reserved: step 1's line comes before auto sets that limit back to its
    default (train.py's RecomputeProbe), step 2's after."""
    import ctypes

    import torch

    cuda = ctypes.CDLL("libcuda.so.1")

    def hook(step, model, loss_sum, blocks):
        if int(os.environ.get("RANK", "0")) != 0:
            return
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        limit = ctypes.c_size_t()
        cuda.cuCtxGetLimit(ctypes.byref(limit), 0)  # CU_LIMIT_STACK_SIZE
        outside = (total - free - torch.cuda.memory_reserved()) / 2**30
        print(f"bench: meminfo step {step}: outside torch {outside:.2f} GiB, stack limit {limit.value} B", flush=True)

    return hook


def token_mixers(layers) -> list:
    return [getattr(layer, n) for layer in layers for n in ("linear_attn", "self_attn") if hasattr(layer, n)]


def keep_gathered(layers) -> None:
    """BENCH lever: each layer keeps its gathered (bf16) parameters from its forward to its backward, which then
    gathers nothing again; with one rank the gather is two copies and a cast of every parameter."""
    for layer in layers:
        layer.set_reshard_after_forward(False)


def recompute_mixers(layers) -> None:
    """BENCH lever: in each layer not recomputed whole, the token mixer alone is recomputed (its activations freed
    after the forward), the norms and MLP kept, by train.py's RecomputedPart (as auto now does for a layer whose MLP
    it keeps). Use with activation_checkpointing as a share, not auto."""
    import train

    classes = {}  # one per kind of mixer, as train.py's probe makes them
    for mixer in token_mixers([layer for layer in layers if not layer.gradient_checkpointing]):
        kind = type(mixer)
        mixer.__class__ = classes.setdefault(kind, type(kind.__name__, (train.RecomputedPart, kind), {}))
        mixer.recomputed = True


def adamw_on_streams(make_optimizer, streams: int):
    """BENCH lever (adamw-streams): train.py's AdamW rebuilt as bench/adamw_kernels.py's AdamWOnStreams, its
    parameters dealt into `streams` buckets of about equal size, each bucket's groups stepped on a CUDA stream of its
    own from step 2 (what fused-streams-K times alone). The scheduler is train.py's lambda over the new groups."""
    import torch
    from adamw_kernels import AdamWOnStreams, on_streams

    def make(model, cfg, total_steps):
        optimizer, scheduler = make_optimizer(model, cfg, total_steps)
        optimizer = AdamWOnStreams(on_streams(optimizer.param_groups, streams))
        groups, streams_made = len(optimizer.param_groups), len(optimizer.streams)
        print(
            f"bench: adamw-streams: {groups} groups, {optimizer.billions()} B parameters on {streams_made} streams",
            flush=True,
        )
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler.lr_lambdas[0])

    return make


def adamw_unclipped(make_optimizer):
    """BENCH lever (adamw-unclipped): train.py's fused AdamW given no grad_scale on a step whose gradient norm it does
    not clip (train_step's scale is then 1, and dividing by 1 changes nothing) or whose norm is not finite (found_inf
    skips that step whatever the scale), so that its kernel writes no gradient back: 4 bytes a parameter, 52.56
    against 44.97 ms for the kernel alone on the geometry (thirty-first round, without found_inf). The price is a host
    wait for the norm before AdamW's dispatch, which the twenty-first round removed; where every step clips (the
    bench's random weights do: thirty-second round), the lever only adds that wait. Prints the steps clipped so far."""

    def make(model, cfg, total_steps):
        optimizer, scheduler = make_optimizer(model, cfg, total_steps)
        step, clipped = optimizer.step, []  # step: as the scheduler wrapped it (wraps copies its mark)

        @functools.wraps(step)
        def unclipped_step(*args, **kwargs):
            scale = optimizer.grad_scale.item() if getattr(optimizer, "grad_scale", None) is not None else 1.0
            clipped.append(math.isfinite(scale) and scale > 1)  # the host waited for the norm (.item())
            if not clipped[-1]:
                optimizer.grad_scale = None
            if len(clipped) % 10 == 0:
                print(f"bench: adamw-unclipped: {sum(clipped)} of {len(clipped)} steps clipped", flush=True)
            return step(*args, **kwargs)

        optimizer.step, optimizer.clipped = unclipped_step, clipped
        return optimizer, scheduler

    return make


def adamw_triton(make_optimizer):
    """BENCH lever (adamw-triton): train.py's AdamW rebuilt as bench/adamw_triton.py's TritonAdamW over the same groups
    and schedule: torch's fused AdamW whose GPU update from step 2 is one Triton kernel a tensor, with train.py's
    clipping and no gradient written back."""
    import torch
    from adamw_triton import TritonAdamW

    def make(model, cfg, total_steps):
        optimizer, scheduler = make_optimizer(model, cfg, total_steps)
        optimizer = TritonAdamW(optimizer.param_groups, fused=True)
        print(f"bench: adamw-triton: {len(optimizer.param_groups)} groups", flush=True)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler.lr_lambdas[0])

    return make


STEP_LEVERS = {"keep-gathered": keep_gathered, "recompute-mixers": recompute_mixers}
OPTIMIZER_LEVERS = {"adamw-triton": adamw_triton, "adamw-streams": adamw_on_streams, "adamw-unclipped": adamw_unclipped}


def with_optimizer_levers(make_optimizer, levers: list[str], streams: int = 2):
    """make_optimizer with the optimizer levers named in levers, in OPTIMIZER_LEVERS's order: adamw-streams (on
    `streams` CUDA streams) builds an optimizer of its own, so adamw-unclipped wraps that one's step; adamw-triton
    builds its own too, and goes alone."""
    if "adamw-triton" in levers and len(set(levers) & set(OPTIMIZER_LEVERS)) > 1:  # each needs torch's fused kernel
        sys.exit(
            "bench: --lever adamw-triton replaces torch's fused AdamW; it does not combine with the other AdamW levers"
        )
    for name, lever in OPTIMIZER_LEVERS.items():
        if name in levers:
            make_optimizer = lever(make_optimizer, streams) if name == "adamw-streams" else lever(make_optimizer)
    return make_optimizer


def free_saved_shards(out: str):
    """BENCH (disk space only): a step hook that deletes the model and optimizer shards of every complete checkpoint,
    as an upload elsewhere would free them, so that a run can save twice on a disk that holds one checkpoint (the
    2-GPU machine's 128 GiB and the 8-layer geometry's 69 GB). Those checkpoints can no longer be resumed from."""

    def hook(step, model, loss_sum, blocks):
        if int(os.environ.get("RANK", "0")) == 0:
            for shard in Path(out).glob("checkpoints/step_*/*.distcp"):
                if (shard.parent / "complete.json").exists():
                    shard.unlink()
                    print(f"bench: deleted {shard} to free disk", flush=True)

    return hook


# Kernel kinds of a step's CUDA time, by name (the first match wins).
KERNEL_KINDS = [
    ("NCCL reduce-scatter", r"reducescatter|reduce_scatter"),
    ("NCCL all-gather", r"allgather|all_gather"),
    ("NCCL, other", r"nccl"),
    ("attention (flash)", r"flash|fmha"),  # before the GEMMs: FlashAttention's kernels are CUTLASS templates
    ("GEMMs (cuBLAS, CUTLASS)", r"nvjet|gemm|cutlass|xmma|cublas"),
    ("causal-conv1d", r"causal_conv1d"),
    ("Gated DeltaNet (fla)", r"chunk(?!_cat)|gated_delta|wy_repr|solve_tril|w_u|l2norm|kkt|cumsum|recurrent|qla"),
    ("cross-entropy", r"cross_entropy|softmax|nll_loss"),
    ("optimizer (AdamW)", r"adam|multi_tensor"),
    ("compiled norms and MLPs (Inductor)", r"^triton_"),
    ("other elementwise and copies", r""),
]


def profile_two_steps(first: int, out: Path):
    """BENCH: a step hook that profiles rank 0 with torch.profiler from step `first`'s backward to step first+2's
    (two steps of work: an optimizer step, a whole step, a forward and backward), writes the trace to
    OUT/trace.json.gz and its summary (summarise_trace) to OUT/profile.json, with the tables on stdout."""
    import torch

    state = {}

    def hook(step, model, loss_sum, blocks):
        if int(os.environ.get("RANK", "0")) != 0:
            return
        if step == first:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            stacks = bool(os.environ.get("BENCH_PROFILE_STACK"))  # by_caller names the module around each launch
            state["profiler"] = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=stacks)
            state["profiler"].__enter__()
            state["t0"] = time.perf_counter()
        elif step == first + 2 and "profiler" in state:
            torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - state["t0"])
            state["profiler"].__exit__(None, None, None)
            state["profiler"].export_chrome_trace(str(out / "trace.json.gz"))  # gzipped by the profiler (.gz)
            summary = summarise_trace(trace_events(out), wall_ms)
            (out / "profile.json").write_text(json.dumps(summary, indent=1))

    return hook


def trace_events(run: Path) -> list:
    with gzip.open(run / "trace.json.gz") as f:
        return json.load(f)["traceEvents"]


def summarise_trace(events: list, wall_ms: float, shown: int = 15) -> dict:
    """A chrome trace's GPU time: kernels (and copies) grouped by KERNEL_KINDS, the longest kernels, and the
    compute stream's idle gaps over 0.2 ms, each with the host calls that returned within 1 ms after it began (a
    sync such as .item() returns once the GPU has caught up; what the host does next is the gap). Collectives run
    on streams of their own, overlapping compute: the kinds add up to more than the wall time."""
    on_gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    kinds, kernels, by_stream = dict.fromkeys([name for name, _ in KERNEL_KINDS], 0.0), {}, {}
    gemms, others = [], []  # the GEMM kernels; the rest, each with its kind
    for e in on_gpu:
        kind = next(n for n, rx in KERNEL_KINDS if re.search(rx, e["name"], re.IGNORECASE))
        kinds[kind] += e["dur"] / 1e3
        if kind.startswith("GEMMs"):
            gemms.append(e)
        else:
            others.append((e, kind))
        ms, count = kernels.get(e["name"], (0.0, 0))
        kernels[e["name"]] = (ms + e["dur"] / 1e3, count + 1)
        if not kind.startswith("NCCL"):
            by_stream[e["tid"]] = by_stream.get(e["tid"], 0.0) + e["dur"] / 1e3
    stream = max(by_stream, key=by_stream.get)  # the compute stream: the most non-collective time
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in on_gpu if e["tid"] == stream)
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start - end > 200:  # microseconds
            gaps.append((end, start))
        end = max(end, stop)
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and "dur" in e]
    total = sum(kinds.values()) or 1.0
    summary = {
        "wall_ms": round(wall_ms, 1),
        "kernel_ms": round(total, 1),
        "compute_stream_busy": round(by_stream[stream] / wall_ms, 4),
        "idle_gaps_ms": round(sum(b - a for a, b in gaps) / 1e3, 1),
        "copies_to_host": sum(count for name, (_, count) in kernels.items() if "DtoH" in name),
        "kinds": {k: {"ms": round(v, 1), "share": round(v / total, 4)} for k, v in kinds.items() if v},
    }
    print(
        f"bench: profile of two steps, {wall_ms:,.0f} ms wall, {total:,.0f} ms of kernels; compute stream busy "
        f"{summary['compute_stream_busy']:.1%} of the wall time, {len(gaps)} idle gaps over 0.2 ms "
        f"({summary['idle_gaps_ms']} ms), {summary['copies_to_host']} copies to the host",
        flush=True,
    )
    for k, v in sorted(summary["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"bench: profile {k:38s} {v['ms']:9,.1f} ms {100 * v['share']:5.1f}%")
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:shown]:
        print(f"bench: profile kernel {ms:9,.1f} ms {count:6d}x {name[:110]}")
    summary["by_caller"] = by_caller(events, others)
    for row in summary["by_caller"][:shown]:
        print(f"bench: profile caller {row['ms']:9,.1f} ms {row['count']:6d}x {row['caller'][:120]}")
    summary["gemms"] = gemm_shapes(events, gemms)
    for row in summary["gemms"][:shown]:
        print(f"bench: profile gemm {row['ms']:9,.1f} ms {row['count']:6d}x {row['tflops']:6.0f} TFLOP/s {row['op']}")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:shown]:
        returned = sorted({e["name"] for e in host if a - 50 <= e["ts"] + e["dur"] <= a + 1000})
        at = f"{(b - a) / 1e3:5.1f} ms at +{(a - spans[0][0]) / 1e3:7.1f} ms"
        print(f"bench: profile idle {at} after {', '.join(returned)[:140]}")
    return summary


MODULE = "nn.Module: "  # the name's prefix of a module's range in a with_stack trace (BENCH_PROFILE_STACK=1)


def launch_ranges(events: list) -> dict:
    """Each launch's correlation id -> the names of the host ranges around it (record_function labels such as FSDP's,
    and ops), outermost first: a sweep over each thread's ranges and launches in time order. Launches are CUDA
    runtime calls (PyTorch's kernels, copies) and driver calls (Triton's: fla's and Inductor's kernels)."""
    by_thread, around = {}, {}
    for e in events:
        module = e.get("cat") == "python_function" and e.get("name", "").startswith(MODULE)
        if (module or e.get("cat") in ("cpu_op", "user_annotation")) and "dur" in e:
            by_thread.setdefault(e["tid"], []).append((e["ts"], 0, -e["dur"], e))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            by_thread.setdefault(e["tid"], []).append((e["ts"], 1, 0, e))
    for items in by_thread.values():
        stack = []
        for ts, is_launch, _, e in sorted(items, key=lambda item: item[:3]):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:  # ended (a range ending where the next begins)
                stack.pop()
            if is_launch:
                around[e["args"]["correlation"]] = [r["name"] for r in stack]
            else:
                stack.append(e)
    return around


def by_caller(events: list, kernels: list) -> list:
    """Kernels' time (kernels: (event, kind) pairs, GEMMs aside) by what launched them: the innermost of FSDP's
    labels (FSDP::...) around the launch, else the innermost op, with the kernel's kind: where the copies, casts and
    elementwise work come from. Before the op: the innermost module around it (BENCH_PROFILE_STACK=1, forward only)
    or, in the backward, the autograd node it runs for."""
    around, rows = launch_ranges(events), {}
    for kernel, kind in kernels:
        names = around.get(kernel.get("args", {}).get("correlation"), [])
        ops = [n for n in names if not n.startswith(MODULE)]
        label = next((n for n in reversed(names) if n.startswith("FSDP")), ops[-1] if ops else "?")
        where = [re.sub(r"_\d+$", "", n.removeprefix(MODULE)) for n in names if n.startswith(MODULE)][-1:]
        where += [n.split(": ")[-1] for n in ops if n.startswith("autograd::engine::evaluate_function")][:1]
        label = f"{where[0]} / {label}" if where and not label.startswith("FSDP") else label
        key = f"{label} [{kind}: {kernel['name'][:40]}]"
        ms, count = rows.get(key, (0.0, 0))
        rows[key] = (ms + kernel["dur"] / 1e3, count + 1)
    rows = sorted(rows.items(), key=lambda kv: -kv[1][0])
    return [{"caller": key, "ms": round(ms, 2), "count": count} for key, (ms, count) in rows]


def gemm_shapes(events: list, gemms: list) -> list:
    """GEMM kernels' time by the op that launched them and its operands' shapes (the profile's record_shapes), each
    row's FLOP rate (2 M N K per product, a batched product's B times that, counted once per op however many
    kernels it launched), a first row for all of them, then the slowest in total first: which products run far
    from the GPU's peak."""
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    ops = {e["args"]["External id"]: e for e in ops if "External id" in e.get("args", {})}
    rows, counted = {}, set()
    for kernel in gemms:
        op_id = kernel.get("args", {}).get("External id")
        op = ops.get(op_id, {})
        mats = [d for d in op.get("args", {}).get("Input Dims", []) if len(d or []) >= 2]
        # addmm's accumulator (a matrix for addmm_) comes first, an out= argument last: the product's two in between
        mats = mats[1:3] if "add" in op.get("name", "") and len(mats) >= 3 else mats[:2]
        flops = 0
        if len(mats) == 2 and mats[0][-1] == mats[1][-2] and op_id not in counted:
            a, b = mats
            counted.add(op_id)
            flops = 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        key = f"{op.get('name', '?')} {' x '.join(map(str, mats))}"
        ms, count, total = rows.get(key, (0.0, 0, 0))
        rows[key] = (ms + kernel["dur"] / 1e3, count + 1, total + flops)
    rows["all GEMMs"] = tuple(map(sum, zip(*rows.values()))) if rows else (0.0, 0, 0)
    return [
        {"op": key, "ms": round(ms, 2), "count": count, "tflops": total / ms / 1e9 if ms else 0.0}
        for key, (ms, count, total) in sorted(rows.items(), key=lambda kv: (kv[0] != "all GEMMs", -kv[1][0]))
    ]


def cmd_seed(args) -> None:
    import runpy

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = {"n": 0}

    def first_step_done(optimizer, *_):
        steps["n"] += 1
        if steps["n"] == 1:
            torch.cuda.synchronize()
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"BENCH seed_first_step time={time.time():.3f}", flush=True)

    register_optimizer_step_post_hook(first_step_done)
    lift_fla_hopper_guard()
    # Benchmark harness, not the seed's behaviour: its random weights are created on the GPU, as ours are (see
    # build_device). Training is untouched: fully_shard then takes GPU parameters, and .cuda() is a no-op.
    from transformers import AutoModelForImageTextToText

    from_config = AutoModelForImageTextToText.from_config

    def from_config_on_gpu(*args, **kwargs):
        t0 = time.perf_counter()
        with torch.device(build_device()):
            model = from_config(*args, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench: seed random init in {time.perf_counter() - t0:.1f}s", flush=True)
        return model

    AutoModelForImageTextToText.from_config = from_config_on_gpu
    sys.argv = [args.script]
    runpy.run_path(args.script, run_name="__main__")


# ------------------------------------------------------------------------------------------------------------
# Per-layer memory
# ------------------------------------------------------------------------------------------------------------


def two_layer_model(args):
    """A 2-layer model of the geometry (one Gated DeltaNet layer, one gated full-attention layer) in bf16 on the GPU,
    training, with the recipe's token_losses; and one block of the data (--data) packed as the recipe packs it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    import train

    lift_fla_hopper_guard()
    device = torch.device("cuda")
    attn = train.resolve_attention(args.attn, device)
    config = AutoConfig.from_pretrained(args.model_config).get_text_config()
    config.num_hidden_layers, config.layer_types = 2, ["linear_attention", "full_attention"]
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    train.require_kernels(model.config)
    model.train()
    model.token_losses = train.token_losses.__get__(model)
    cfg = train.Config(
        model_name=args.model_config,
        model_revision="",
        tokenizer_name=args.tokenizer,
        dataset_name=args.data,
        dataset_split="train",
        max_seq_len=args.seq_len,
        num_workers=0,
        pack_buffer_blocks=4,
    )
    tokenizer = train.load_tokenizer(cfg)
    return model, train.to_device(next(iter(train.block_loader(cfg, tokenizer, "train", 0, 1, 1))), device)


def cmd_layers(args) -> None:
    """Activation memory per decoder layer at one block length, on one GPU, for the memory arithmetic of
    docs/BENCHMARKS.md: a 2-layer model of the geometry (one Gated DeltaNet layer, one gated full-attention
    layer) in bf16, the recipe's packing of the real data into one block, the recipe's token_losses. For each of
    eager / compiled (train.compile_elementwise) x recomputed / kept: what each layer's forward leaves allocated
    until backward (forward hooks around it), the peak of forward + backward over what was allocated before,
    and the time of forward + backward. Then the LM head's chunked loss alone at several loss_chunk_tokens."""
    import torch

    import train

    model, block = two_layer_model(args)
    config, device = model.config, torch.device("cuda")
    layers = model.model.layers
    kinds = [layer.block_type for layer in layers]
    state_bytes = {k: sum(p.numel() for p in layer.parameters()) * 16 for k, layer in zip(kinds, layers)}
    retained = {}

    def before(layer, *_):
        retained[layer.block_type] = -torch.cuda.memory_allocated()

    def after(layer, *_):
        retained[layer.block_type] += torch.cuda.memory_allocated()

    for layer in layers:
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    rows = []

    def measure(name: str, recompute: bool) -> None:
        for layer in layers:
            layer.gradient_checkpointing = recompute
        for _ in range(3):  # the first runs autotune fla's kernels and compile; the last is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.token_losses(block, 4096).sum().backward()
            end.record()
            torch.cuda.synchronize()
        row = {
            "variant": name,
            "recompute": recompute,
            **{f"kept_mib_{k}": v / 2**20 for k, v in retained.items()},
            "peak_over_base_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
            "fwd_bwd_ms": start.elapsed_time(end),
        }
        rows.append(row)
        print("bench layers:", json.dumps(row), flush=True)

    if not args.long:  # at long blocks, eager fp32 norms and kept layers need tens of GiB
        measure("eager", True)
        measure("eager", False)
    train.compile_elementwise(layers)
    measure("compiled", True)
    if not args.long:
        measure("compiled", False)
    from long_levers import tile_mlps

    for tile_tokens in args.mlp_tiles:  # a recomputed layer's MLP in tiles (issue 26): what it saves, what it costs
        tile_mlps(layers, tile_tokens)
        measure(f"compiled, MLP in tiles of {tile_tokens}", True)
    model.zero_grad(set_to_none=True)

    # The LM head's loss alone: hidden states of the whole block, loss positions of the real block.
    hidden = torch.randn(1, args.seq_len, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    model.model.forward = lambda **kwargs: type("Out", (), {"last_hidden_state": hidden})
    for chunk in (8192, 4096, 2048, 1024):
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.token_losses(block, chunk).sum().backward()
            end.record()
            torch.cuda.synchronize()
            hidden.grad = None
            model.zero_grad(set_to_none=True)
        row = {
            "variant": f"lm head loss, loss_chunk_tokens {chunk}",
            "peak_over_base_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
            "fwd_bwd_ms": start.elapsed_time(end),
        }
        rows.append(row)
        print("bench layers:", json.dumps(row), flush=True)
    summary = {
        "seq_len": args.seq_len,
        "block_tokens": block["tokens"],
        "block_loss_tokens": block["loss_tokens"],
        "layer_param_state_bytes_16_per_param": state_bytes,
        "hidden_state_mib": args.seq_len * config.hidden_size * 2 / 2**20,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


# ------------------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------------------


def geometry_flops(model_config: str) -> dict:
    """FLOPs per token of a geometry, counted as the recipe counts them (train.matmul_params on a meta-device
    model), plus the Gated DeltaNet recurrence that the recipe leaves out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    sys.path.insert(0, str(ROOT))
    import train

    config = AutoConfig.from_pretrained(model_config)
    image_text = type(config) in AutoModelForImageTextToText._model_mapping
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_config(config)
    text = config.get_text_config()
    n_matmul = train.matmul_params(model)
    gdn_layers = sum(t == "linear_attention" for t in (getattr(text, "layer_types", None) or []))
    dk, dv = getattr(text, "linear_key_head_dim", 0), getattr(text, "linear_value_head_dim", 0)
    heads = getattr(text, "linear_num_value_heads", 0)
    # Chunked gated delta rule, forward, per value head and token (chunk C): the inter-chunk state work
    # (v_new = u - w S, o = q S, S += k^T v_new: 6 dk dv) + the intra-chunk triangular products
    # (K K^T, A (beta k), q k^T: C dk each over half a square; A (beta v), (q k^T) v_new: C dv) + the
    # triangular solve (C^2 / 3). Training = 3x forward.
    gdn_fwd_per_head = 6 * dk * dv + GDN_CHUNK * (3 * dk + 2 * dv) + GDN_CHUNK**2 / 3
    gdn = 3 * gdn_layers * heads * gdn_fwd_per_head
    return {
        "matmul_params": n_matmul,
        "flops_per_token_6N": 6 * n_matmul,
        "attention_flops_per_sq_token": train.attention_flops_per_sq_token(model),
        "gdn_flops_per_token": gdn,
        "gdn_fraction_of_6N": gdn / (6 * n_matmul),
        "layers": text.num_hidden_layers,
        "gdn_layers": gdn_layers,
    }


def cmd_losses(args) -> None:
    """Two runs' loss curves side by side (metrics.jsonl): the mean loss per window of steps, and the final loss,
    e.g. a setting that changes the numerics (float8) against the defaults over the same data."""
    curves = []
    for run in (args.a, args.b):
        records = (json.loads(line) for line in open(Path(run) / "metrics.jsonl"))
        curves.append({r["step"]: r["loss"] for r in records if "loss" in r and "step" in r})
    ends = [int(e) for e in args.windows.split(",")]
    print(f"steps      {Path(args.a).name:>24s} {Path(args.b).name:>24s}   b - a")
    for lo, hi in zip([1] + [e + 1 for e in ends[:-1]], ends):
        steps = [s for s in curves[0] if lo <= s <= hi and s in curves[1]]
        if steps:
            a, b = (sum(c[s] for s in steps) / len(steps) for c in curves)
            print(f"{lo:>4d}-{hi:<4d}  {a:24.3f} {b:24.3f}   {b - a:+.3f}")
    last = max(set(curves[0]) & set(curves[1]))
    print(f"final ({last}) {curves[0][last]:23.3f} {curves[1][last]:24.3f}   {curves[1][last] - curves[0][last]:+.3f}")


def cmd_profile(args) -> None:
    """The profile of a run made with --profile-from, summarised again from its trace.json.gz."""
    for run in map(Path, args.runs):
        print(run.name)
        summarise_trace(trace_events(run), json.loads((run / "profile.json").read_text())["wall_ms"], args.shown)


FULL_BLOCK = 0.95  # a step whose blocks are this full counts as full (a pack buffer's last block is far emptier)


def cmd_steps(args) -> None:
    """Per step, from metrics.jsonl: tokens/s/GPU, non-padding fraction, allocator retries so far; then the mean
    tokens/s over the timed steps with full blocks, which a short window that meets a sparse block understates."""
    for run in args.runs:
        steps = [json.loads(line) for line in open(Path(run) / "metrics.jsonl")]
        steps = [r for r in steps if "tokens_per_s_per_gpu" in r]
        print(Path(run).name)
        for r in steps:
            print(
                f"  step {r['step']:4d}  {r['tokens_per_s_per_gpu']:9,.0f} tok/s/GPU  "
                f"fill {r['non_padding_fraction']:6.1%}  retries {r.get('alloc_retries', '-')}"
            )
        full = [
            r["tokens_per_s_per_gpu"]
            for r in steps
            if r["step"] > WARMUP_STEPS and r["non_padding_fraction"] > FULL_BLOCK
        ]
        if full:
            print(f"  mean over {len(full)} timed steps with full blocks: {sum(full) / len(full):,.0f} tok/s/GPU")


STEP_LINE = re.compile(r"step (\d+)/\d+ \|.*? ([\d,]+) tok/s/gpu \|.*? mfu ([\d.]+)%")  # train.py's and trl_peer.py's
TRL_STEP = re.compile(r"\| (\d+) tokens, \d+ loss tokens \| ([\d.]+) s \|")  # trl_peer.py's: the step's own figures


def cmd_logsteps(args) -> None:
    """A run's rates from its log's step lines, for a run whose metrics.jsonl did not come back from the GPU machine:
    tok/s/GPU and MFU over steps FIRST..LAST, each step weighted by its seconds as `summary` weights them. A line of
    bench/trl_peer.py gives its step's tokens and seconds; one of train.py, its tok/s/GPU only, so its block is taken
    as full (one block a step, one GPU: the seconds are the block length over the rate)."""
    steps = {}
    for line in Path(args.log).read_text().splitlines():
        if m := STEP_LINE.search(line):
            rate, mfu, timed = float(m[2].replace(",", "")), float(m[3]), TRL_STEP.search(line)
            tokens_and_seconds = (int(timed[1]), float(timed[2])) if timed else (args.seq_len, args.seq_len / rate)
            steps[int(m[1])] = (*tokens_and_seconds, mfu)
    chosen = [i for i in sorted(steps) if args.first <= i <= (args.last or max(steps)) and i not in args.skip]
    if not chosen:  # the seed's log, say: its rate is its own `BENCH seed tok_s_gpu=...` line
        sys.exit(f"{args.log}: no step line of train.py or bench/trl_peer.py among the steps chosen")
    tokens, seconds = sum(steps[i][0] for i in chosen), sum(steps[i][1] for i in chosen)
    mfu = sum(steps[i][2] * steps[i][1] for i in chosen) / seconds
    print(
        f"{Path(args.log).name}: steps {chosen[0]}-{chosen[-1]} ({len(chosen)}): {tokens / seconds:,.0f} tok/s/GPU, "
        f"MFU {mfu:.1f}%"
    )


def cmd_packing(args) -> None:
    """The recipe's PackedBlocks (best-fit decreasing per pack buffer, one DataLoader worker's stream per rank)
    over the data, on CPU: each rank's block count, mean fill, and the blocks under FULL_BLOCK, by position."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    import train

    cfg = train.Config(model_name="-", dataset_name=args.data, max_seq_len=args.seq_len, num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for rank in range(args.ranks):
        fills = [
            block["tokens"] / args.seq_len
            for block in train.PackedBlocks(cfg, tokenizer, "train", rank, args.ranks, epochs=1)
            if "input_ids" in block
        ]
        sparse = ", ".join(f"block {i + 1}: {f:.0%}" for i, f in enumerate(fills) if f < FULL_BLOCK)
        print(
            f"rank {rank}: {len(fills)} blocks, mean fill {sum(fills) / len(fills):.1%}; "
            f"under {FULL_BLOCK:.0%}: {sparse}"
        )


def cmd_flops(args) -> None:
    print(json.dumps(geometry_flops(args.model_config), indent=1))


# ------------------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------------------


def rate(steps: list, key: str) -> float:
    """A per-step rate over (record, seconds) steps, weighted by their seconds; a None (no MFU on CPU) counts 0."""
    return sum((r[key] or 0) * dt for r, dt in steps) / sum(dt for _, dt in steps)


def ours_numbers(run: Path, launch: float) -> dict:
    if not (run / "metrics.jsonl").exists():
        return {"error": "no metrics.jsonl (no step finished; see log)"}
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = sorted((r for r in records if "loss" in r and "step" in r), key=lambda r: r["step"])
    if not steps:
        return {"error": "no step records"}
    world = None
    log = (run / "log.txt").read_text(errors="replace") if (run / "log.txt").exists() else ""
    if m := re.search(r"world_size (\d+)", log):
        world = int(m.group(1))
    prev, timed = None, []
    for r in steps:
        if prev is not None and r["step"] > WARMUP_STEPS:
            timed.append((r, r["elapsed_s"] - prev["elapsed_s"]))
        prev = r
    out = {
        "steps": steps[-1]["step"],
        "first_step_s": steps[0]["time"] - launch,
        "peak_mem_gib": max(r["memory_gib"] for r in steps),
        "final_loss": steps[-1]["loss"],
    }
    if m := re.search(r"sharded over \d+ ranks, \w+ weights, ready in ([\d.]+)s", log):
        out["model_build_s"] = float(m.group(1))
    if timed:
        out.update(
            timed_steps=len(timed),
            s_step=sum(dt for _, dt in timed) / len(timed),
            tok_s_gpu=rate(timed, "tokens_per_s_per_gpu"),
            loss_tok_s_gpu=rate(timed, "loss_tokens_per_s_per_gpu"),
            mfu_recipe=rate(timed, "mfu"),
            # Over the timed steps: a pack buffer's last block is sparse, and a short window that meets one reads
            # tokens/s low (docs/BENCHMARKS.md, "Fourth round")
            fill=sum(r["non_padding_fraction"] for r, _ in timed) / len(timed),
            world=world,
        )
        # A step over 5x the median is a one-time stall (e.g. Triton autotuning a block shape met for the first
        # time): the rate without such steps is the steady state's (docs/BENCHMARKS.md, eleventh round).
        median = sorted(dt for _, dt in timed)[len(timed) // 2]
        if stalls := [(r, dt) for r, dt in timed if dt > 5 * median]:
            steady = [(r, dt) for r, dt in timed if dt <= 5 * median]
            out.update(
                stalls=[[r["step"], dt] for r, dt in stalls],
                tok_s_gpu_without_stalls=rate(steady, "tokens_per_s_per_gpu"),
                loss_tok_s_gpu_without_stalls=rate(steady, "loss_tokens_per_s_per_gpu"),
            )
    return out


def seed_numbers(run: Path, launch: float) -> dict:
    log = (run / "log.txt").read_text(errors="replace")
    out = {}
    if m := re.search(r"BENCH seed tok_s_gpu=(\S+) s_step=(\S+) steps=(\d+) .*peak_mem_gib=(\S+) loss=(\S+)", log):
        out.update(
            tok_s_gpu=float(m.group(1)),
            s_step=float(m.group(2)),
            timed_steps=int(m.group(3)),
            peak_mem_gib=float(m.group(4)),
            final_loss=float(m.group(5)),
        )
    if m := re.search(r"BENCH seed_first_step time=(\S+)", log):
        out["first_step_s"] = float(m.group(1)) - launch
    if "OutOfMemoryError" in log or "CUDA out of memory" in log:
        out["error"] = "CUDA out of memory"
    elif not out.get("tok_s_gpu"):
        out["error"] = "no BENCH line (see log)"
    return out


def trl_notes(run: Path) -> dict:
    """What a TRL run's log says it kept apart and what not (bench/trl_peer.py's `bench: trl ...` lines)."""
    log = (run / "log.txt").read_text(errors="replace") if (run / "log.txt").exists() else ""
    out = {"trl_limitations": re.findall(r"^bench: trl limitation: (.*)$", log, re.MULTILINE)}
    if m := re.search(r"^bench: trl block-diagonal: (.*)$", log, re.MULTILINE):
        out["trl_block_diagonal"] = m.group(1)
    if "OutOfMemoryError" in log or "CUDA out of memory" in log:
        out["error"] = "CUDA out of memory"
    return out


def means_of_repeats(runs: list) -> list:
    """For each kind and variant run more than once at one GPU count, geometry and block length (BENCH_REPEAT): the
    mean tok/s/GPU over its runs that finished, and for ours the ratio of that mean to the seed's mean there."""
    groups = {}
    for r in runs:
        if r.get("tok_s_gpu") and not r.get("error"):
            key = (r["kind"], r["variant"], r["gpus"], r["layers"], r["seq_len"])
            groups.setdefault(key, []).append(r["tok_s_gpu"])
    means = []
    for (kind, variant, gpus, layers, seq_len), rates in groups.items():
        if len(rates) > 1:
            seed = groups.get(("seed", "seed", gpus, layers, seq_len))
            row = {"kind": kind, "variant": variant, "gpus": gpus, "layers": layers, "seq_len": seq_len}
            row |= {"runs": len(rates), "tok_s_gpu": sum(rates) / len(rates), "tok_s_gpu_each": rates}
            if kind == "ours" and seed:
                row["over_seed"] = row["tok_s_gpu"] / (sum(seed) / len(seed))
            means.append(row)
    return means


def cmd_summary(args) -> None:
    work = Path(args.work)
    runs = []
    for line in (work / "runs.tsv").read_text().splitlines():
        kind, gpus, layers, seq, run, launch, rc, *variant = line.split("\t")  # older lines have no variant
        run, launch = Path(run), float(launch)
        # TRL's runs (bench/trl_peer.py) write ours' metrics.jsonl schema; their log names what mixes, if anything
        numbers = ours_numbers(run, launch) if kind in ("ours", "trl") else seed_numbers(run, launch)
        if kind == "trl":
            numbers |= trl_notes(run)
        if rc != "0" and "error" not in numbers:
            numbers["error"] = f"exit status {rc}"
        variant = variant[0] if variant else kind if kind == "seed" else "default"
        runs.append(
            {"kind": kind, "variant": variant, "gpus": int(gpus), "layers": int(layers), "seq_len": int(seq), "rc": rc}
            | numbers
        )
    flops = {}
    for r in runs:
        key = r["layers"]
        if key not in flops:
            flops[key] = geometry_flops(str(ROOT / "bench" / "configs" / f"qwen3.8-27b-geometry-{key}layers"))
        f = flops[key]
        if r["kind"] == "seed":
            r["fill"] = 1.0  # the seed concatenates conversations and splits them across blocks: no padding
        if r.get("s_step"):
            r["block_tok_s_gpu"] = r["seq_len"] / r["s_step"]  # every token of the block, padding included
            # The same formula for both: 6 N per token trained (no attention / GDN term), dense bf16 peak.
            r["mfu_6N"] = f["flops_per_token_6N"] * r["tok_s_gpu"] / PEAK_BF16_FLOPS
    header = (
        f"{'run':<5} {'variant':<14} {'GPUs':>4} {'layers':>6} {'block':>6} {'tok/s/GPU':>10} {'loss tok/s':>10} "
        f"{'s/step':>7} {'fill':>6} {'MFU 6N':>7} {'MFU rcp':>7} {'peak GiB':>8} {'1st step s':>10}  note"
    )
    print(header)

    def num(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    for r in runs:
        print(
            f"{r['kind']:<5} {r['variant']:<14} {r['gpus']:>4} {r['layers']:>6} {r['seq_len']:>6} "
            f"{num(r, 'tok_s_gpu', ',.0f'):>10} {num(r, 'loss_tok_s_gpu', ',.0f'):>10} {num(r, 's_step', '.3f'):>7} "
            f"{num(r, 'fill', '.1%'):>6} {num(r, 'mfu_6N', '.1%'):>7} {num(r, 'mfu_recipe', '.1%'):>7} "
            f"{num(r, 'peak_mem_gib', '.1f'):>8} {num(r, 'first_step_s', '.0f'):>10}  "
            f"{r.get('error', '')}"
        )
    ratios = []
    # a/b for the runs of one GPU count, geometry and block length: ours against the seed, TRL against the seed and
    # against ours. TRL's padding-free rows are up to a block long, so its s/step is not comparable: tok/s/GPU is.
    for a_kind, b_kind in (("ours", "seed"), ("trl", "seed"), ("trl", "ours")):
        for a in runs:
            for b in runs:
                same = all(a[k] == b[k] for k in ("gpus", "layers", "seq_len"))
                if a["kind"] == a_kind and b["kind"] == b_kind and same and a.get("s_step") and b.get("s_step"):
                    ratio = {
                        "pair": f"{a_kind}/{b_kind}",
                        "variant": next((r["variant"] for r in (a, b) if r["kind"] == "ours"), None),  # ours
                        "gpus": a["gpus"],
                        "layers": a["layers"],
                        "seq_len": a["seq_len"],
                        "tok_s_gpu_ratio": a["tok_s_gpu"] / b["tok_s_gpu"],
                        "step_time_ratio": b["s_step"] / a["s_step"],  # b's s/step over a's
                        "peak_mem_gib": [a.get("peak_mem_gib"), b.get("peak_mem_gib")],
                    }
                    if a_kind == "ours":  # the key older summaries have
                        ratio["step_time_ratio_seed_over_ours"] = ratio["step_time_ratio"]
                    ratios.append(ratio)
    for r in ratios:
        where = f"{r['gpus']} GPU(s), {r['layers']} layers, {r['seq_len']} tokens"
        if r["pair"] == "ours/seed":
            print(
                f"ratio ours ({r['variant']})/seed, {where}: tok/s/GPU x{r['tok_s_gpu_ratio']:.2f} (non-padding "
                f"tokens; seed blocks have none), seed s/step / ours s/step x{r['step_time_ratio']:.2f}"
            )
        else:
            b = "seed" if r["pair"] == "trl/seed" else f"ours ({r['variant']})"
            peaks = "/".join(format(p, ".1f") if p is not None else "-" for p in r["peak_mem_gib"])
            print(
                f"ratio trl/{b}, {where}: tok/s/GPU x{r['tok_s_gpu_ratio']:.2f} (non-padding tokens), "
                f"{b}/trl x{1 / r['tok_s_gpu_ratio']:.2f}; peak GiB trl/{b.split()[0]} {peaks}"
            )
    means = means_of_repeats(runs)
    for m in means:
        where = f"{m['gpus']} GPU(s), {m['layers']} layers, {m['seq_len']} tokens"
        rates = ", ".join(f"{v:,.0f}" for v in m["tok_s_gpu_each"])
        what = f"mean of {m['runs']} runs, {m['kind']} ({m['variant']}), {where}"
        print(f"{what}: {m['tok_s_gpu']:,.0f} tok/s/GPU ({rates})")
        if m.get("over_seed"):
            print(f"ratio of means ours ({m['variant']})/seed, {where}: tok/s/GPU x{m['over_seed']:.3f}")
    for r in runs:
        if r.get("stalls"):
            steps = ", ".join(f"step {step} ({dt:.1f} s)" for step, dt in r["stalls"])
            print(
                f"stalls, {r['kind']} ({r['variant']}), {r['gpus']} GPU(s), {r['seq_len']} tokens: {steps}; without "
                f"them {r['tok_s_gpu_without_stalls']:,.0f} tok/s/GPU, "
                f"{r['loss_tok_s_gpu_without_stalls']:,.0f} loss tok/s"
            )
    for r in runs:
        for what in r.get("trl_limitations", []):
            print(f"trl limitation, {r['gpus']} GPU(s), {r['layers']} layers, {r['seq_len']} tokens: {what}")
    for layers, f in flops.items():
        print(
            f"flops {layers} layers: 6N = {f['flops_per_token_6N'] / 1e9:.2f} GFLOP/token; Gated DeltaNet recurrence "
            f"{f['gdn_flops_per_token'] / 1e6:.1f} MFLOP/token = {f['gdn_fraction_of_6N']:.2%} of 6N (left out)"
        )
    summary = {"runs": runs, "ratios": ratios, "means": means, "flops": {str(k): v for k, v in flops.items()}}
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


def add_run_arguments(p: argparse.ArgumentParser, steps: bool = True) -> None:
    """What every measured run names (ours, layers, trl_peer.py's run): geometry, tokenizer, data, block, output."""
    p.add_argument("--model-config", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, default=32768)
    if steps:
        p.add_argument("--steps", type=int, default=12)
    p.add_argument("--attn", default="torch_varlen", help="torch_varlen (as ours and the seed) or sdpa")
    p.add_argument("--out", required=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("data")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--copies", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("ours")
    add_run_arguments(p)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE: a recipe setting (YAML scalar)")
    p.add_argument("--free-saved-shards", action="store_true", help="delete complete checkpoints' shards (disk)")
    p.add_argument("--profile-from", type=int, default=0, help="profile two steps from this one (rank 0)")
    p.add_argument("--mlp-tiles", type=int, default=0, help="recomputed layers' MLPs in tiles (bench/long_levers.py)")
    p.add_argument("--saved-on-host-mib", type=int, default=0, help="recomputed layers' inputs this large on the host")
    levers = sorted([*STEP_LEVERS, *OPTIMIZER_LEVERS])
    p.add_argument("--lever", action="append", default=[], choices=levers, help="a step-time lever")
    p.add_argument("--adamw-streams", type=int, default=2, help="the CUDA streams of --lever adamw-streams")
    p = sub.add_parser("seed")
    p.add_argument("script")
    p = sub.add_parser("layers")
    add_run_arguments(p, steps=False)
    p.add_argument("--mlp-tiles", type=int, nargs="*", default=[], help="also: recomputed, MLPs in tiles of N tokens")
    p.add_argument("--long", action="store_true", help="only compiled, recomputed variants (long blocks)")
    p = sub.add_parser("summary")
    p.add_argument("work")
    p.add_argument("--out", default="")
    p = sub.add_parser("flops")
    p.add_argument("--model-config", required=True)
    p = sub.add_parser("losses")
    p.add_argument("a", help="a run directory (its metrics.jsonl)")
    p.add_argument("b")
    p.add_argument("--windows", default="10,25,50,75,100", help="last step of each window")
    p = sub.add_parser("steps")
    p.add_argument("runs", nargs="+", help="run directories (their metrics.jsonl)")
    p = sub.add_parser("profile")
    p.add_argument("runs", nargs="+", help="run directories made with --profile-from (their trace.json.gz)")
    p.add_argument("--shown", type=int, default=15, help="the longest kernels and idle gaps shown")
    p = sub.add_parser("logsteps")
    p.add_argument("log", help="a run's log.txt (or the output of run_bench.sh)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--first", type=int, default=WARMUP_STEPS + 1)
    p.add_argument("--last", type=int, default=0, help="0: the last step logged")
    p.add_argument("--skip", type=int, nargs="*", default=[], help="steps left out (e.g. profiled ones)")
    p = sub.add_parser("packing")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    {
        "data": cmd_data,
        "ours": cmd_ours,
        "seed": cmd_seed,
        "layers": cmd_layers,
        "summary": cmd_summary,
        "flops": cmd_flops,
        "losses": cmd_losses,
        "steps": cmd_steps,
        "logsteps": cmd_logsteps,
        "profile": cmd_profile,
        "packing": cmd_packing,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
