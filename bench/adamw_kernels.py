"""BENCH: AdamW's step over the 8-layer geometry's trained parameters (fp32 masters, as train.py keeps them on one
GPU), timed on the GPU alone: how close each implementation comes to the memory bandwidth a plain copy reaches.

    python3 bench/adamw_kernels.py [--model-config bench/configs/qwen3.8-27b-geometry-8layers] [--steps 5]
        [--variants per-tensor compiled-foreach dtensor]

Prints one line per implementation: ms per step, and the GB/s of the bytes an update must move (param, gradient
and the two moments read; param and moments written: 28 bytes a parameter in fp32). torch's fused AdamW, with
train.py's grad_scale (its kernel then writes the gradients back too) and without, and torch's foreach AdamW always
run; the variants are compiled ones, fused-streams-K or adamw-triton (docs/BENCHMARKS.md, nineteenth, thirty-first
and thirty-fourth rounds)."""

import argparse
import time
from functools import partial

import torch

LR, BETAS, EPS, WEIGHT_DECAY = 1e-5, (0.9, 0.999), 1e-8, 0.1  # torch's AdamW defaults, but the rate and decay


def trained_shapes(model_config: str) -> list:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def timed(fn, steps: int) -> float:
    fn()  # warm-up (compiles, allocates state)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", default="bench/configs/qwen3.8-27b-geometry-8layers")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=["per-tensor", "compiled-foreach", "dtensor"])
    p.add_argument("--drop", nargs="*", default=[], help="tensors left out (by name), to fit a smaller GPU")
    args = p.parse_args()
    shapes = [(name, shape) for name, shape in trained_shapes(args.model_config) if name not in args.drop]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for _, s in shapes]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    n = sum(q.numel() for q in params)
    names = [name for name, _ in shapes]
    embedding = params[names.index("model.embed_tokens.weight")] if "model.embed_tokens.weight" in names else None
    groups = [
        {"params": [q for q in params if q.ndim >= 2 and q is not embedding]},
        {"params": [q for q in params if q.ndim < 2 or q is embedding], "weight_decay": 0.0},
    ]
    print(f"adamw: {len(params)} tensors, {n / 1e9:.3f} B parameters (fp32)", flush=True)
    big = torch.empty(2**30, device="cuda")
    copy_ms = timed(big.clone, args.steps)
    print(f"adamw: copy of 4 GiB: {copy_ms:.2f} ms, {2 * big.numel() * 4 / copy_ms / 1e6:,.0f} GB/s", flush=True)
    del big
    scale = torch.tensor(1.7, device="cuda")

    def report(name: str, ms: float) -> None:
        print(f"adamw: {name:46s} {ms:7.2f} ms  {n * 28 / ms / 1e6:7,.0f} GB/s", flush=True)

    no_inf = torch.zeros((), device="cuda")
    for name, kwargs, clipped in (
        ("torch fused (grad_scale, found_inf: train.py's)", {"fused": True}, True),
        ("torch fused, no grad_scale (no grads written)", {"fused": True}, False),
        ("torch foreach", {"foreach": True}, False),
    ):  # each its own copy of the groups: AdamW writes its defaults (fused, foreach) into the dicts it is given
        opt = torch.optim.AdamW([{**g} for g in groups], lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
        if clipped:  # the kernel then divides each gradient by the scale and writes it back: 4 bytes a parameter
            opt.grad_scale, opt.found_inf = scale, no_inf
        report(name, timed(opt.step, args.steps))
        opt.state.clear()
        del opt
        torch.cuda.empty_cache()

    torch._dynamo.config.recompile_limit = 64
    dtensors = as_dtensors(params) if "dtensor" in args.variants else None
    for variant in args.variants:
        step = None  # the last variant's state freed first
        torch.cuda.empty_cache()
        t = time.perf_counter()
        if variant.startswith("fused-streams"):  # fused-streams-K
            step = fused_on_streams_step(groups, int(variant.rsplit("-", 1)[1]))
        elif variant == "adamw-triton":  # bench/adamw_triton.py's TritonAdamW, as the adamw-triton lever steps it
            step = adamw_triton_step(groups)
        elif variant.startswith("triton"):  # triton-BLOCK-WARPS
            _, block, warps = variant.split("-")
            step = triton_step(params, groups, int(block), int(warps))
        elif variant == "per-tensor":
            step = per_tensor_step(params, groups)
        elif variant == "compiled-foreach":  # torch's foreach AdamW, torch.compile'd with the clipping before it
            step = compiled_foreach_step(params, groups)
        else:  # the same on FSDP2's parameters (DTensors, a mesh of one)
            of = {id(q): d for q, d in zip(params, dtensors)}
            step = compiled_foreach_step(dtensors, [{**g, "params": [of[id(q)] for q in g["params"]]} for g in groups])
        step(scale)
        print(f"adamw: {variant}: first step (compiles) {time.perf_counter() - t:.1f} s", flush=True)
        report(variant, timed(partial(step, scale), args.steps))


def per_tensor_step(params: list, groups: list):
    """One compiled update a tensor, each flattened, the scalars as 0-d tensors: one graph for every step, whose
    learning rate and bias corrections change. (With the scalars as Python floats, the nineteenth round's first
    form, Inductor recompiled at each new value and, on CPU, made a wrong step when the first bias correction
    equalled 1 - beta1, as it does at step 1: tests/test_bench.py.)"""

    @torch.compile(dynamic=True)
    def update(p, g, m, v, lr, wd, b1, b2, eps, bc1, bc2_sqrt, inv_scale):
        g = g * inv_scale
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - lr * wd).addcdiv_(m, v.sqrt() / bc2_sqrt + eps, value=-lr / bc1)

    on = dict(device=params[0].device)
    moments = [(torch.zeros_like(q).view(-1), torch.zeros_like(q).view(-1)) for q in params]
    decay = {id(q) for q in groups[0]["params"]}
    wds = [torch.tensor(WEIGHT_DECAY if id(q) in decay else 0.0, **on) for q in params]
    bias_corrections = 1 - BETAS[0], (1 - BETAS[1]) ** 0.5  # step 1's: 1 - beta1, sqrt(1 - beta2)
    scalars = [torch.tensor(x, **on) for x in (LR, *BETAS, EPS, *bias_corrections)]

    def step(scale):
        inv = 1 / scale
        lr, b1, b2, eps, bc1, bc2 = scalars
        for q, (m, v), wd in zip(params, moments, wds):
            update(q.data.view(-1), q.grad.view(-1), m, v, lr, wd, b1, b2, eps, bc1, bc2, inv)

    return step


def dealt(groups: list, k: int) -> list[list[dict]]:
    """The param groups' parameters dealt into k buckets of about equal size (the largest first, each to the smallest
    bucket), each bucket the same groups (settings kept) over its own parameters."""
    sizes, buckets = [0] * k, [[[] for _ in groups] for _ in range(k)]  # bucket -> group -> params
    for q, g in sorted(
        ((q, g) for g, group in enumerate(groups) for q in group["params"]), key=lambda t: -t[0].numel()
    ):
        i = sizes.index(min(sizes))
        sizes[i] += q.numel()
        buckets[i][g].append(q)
    dealt = [[{**group, "params": qs} for group, qs in zip(groups, bucket) if qs] for bucket in buckets]
    return [bucket for bucket in dealt if bucket]  # fewer than k where there are fewer parameters


class AdamWOnStreams(torch.optim.AdamW):
    """torch's fused AdamW whose param groups each name a stream (a "stream" index, as on_streams deals them). Once
    every parameter with a gradient has its moments (made on the current stream, as train.py's are), each stream's
    groups step on a CUDA stream of their own: each of the fused kernel's launches runs at most 320 blocks of 512
    threads where its kernel arguments are 4 KB (multi_tensor_apply's limit for its four lists), each ending in a
    partial wave, so launches on two streams may overlap where one stream's cannot (torch 2.11.0+cu130 has that
    limit; two streams took 9% off the kernel on an H100 and 15% on an H200, where 3-6 took no more: thirty-second
    and thirty-third rounds). Each stream waits for the current one before its step, and the current one for all
    after it. Optimizer hooks would run once for the step and once for each stream's."""

    def __init__(self, groups: list, **kwargs):
        super().__init__(groups, fused=True, **kwargs)
        self.streams = [torch.cuda.Stream() for _ in {g["stream"] for g in self.param_groups}]

    def step(self, closure=None):
        made = all(p in self.state for g in self.param_groups for p in g["params"] if p.grad is not None)
        if not made:  # the moments made on the current stream (step 1)
            return super().step()
        groups, main = self.param_groups, torch.cuda.current_stream()
        for i, stream in enumerate(self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                self.param_groups = [g for g in groups if g["stream"] == i]
                try:
                    super().step()
                finally:
                    self.param_groups = groups
        for stream in self.streams:
            main.wait_stream(stream)

    def billions(self) -> list[float]:  # parameters on each stream, in billions
        sizes = [0] * len(self.streams)
        for g in self.param_groups:
            sizes[g["stream"]] += sum(q.numel() for q in g["params"])
        return [round(n / 1e9, 2) for n in sizes]


def on_streams(groups: list, k: int) -> list[dict]:
    """groups dealt into k buckets, each group naming its bucket's stream (AdamWOnStreams's groups)."""
    return [{**group, "stream": i} for i, bucket in enumerate(dealt(groups, k)) for group in bucket]


def fused_on_streams_step(groups: list, k: int):
    """torch's fused AdamW over k buckets of the parameters, each on a stream of its own (AdamWOnStreams), with
    train.py's grad_scale and found_inf; its first step makes the moments on the current stream, as a run's would."""
    opt = AdamWOnStreams(on_streams(groups, k), lr=LR, weight_decay=WEIGHT_DECAY)
    print(f"adamw: fused-streams-{k}: buckets of {opt.billions()} B parameters", flush=True)
    return clipped_step(opt)


def adamw_triton_step(groups: list):
    """TritonAdamW: torch's fused AdamW at its first step (which makes the moments), then its Triton kernel."""
    from adamw_triton import TritonAdamW

    return clipped_step(TritonAdamW([{**g} for g in groups], lr=LR, weight_decay=WEIGHT_DECAY, fused=True))


def clipped_step(opt):
    """opt's step as train_step gives it: the clipping's grad_scale, and found_inf 0 (a finite norm)."""
    no_inf = torch.zeros((), device="cuda")

    def step(scale):
        opt.grad_scale, opt.found_inf = scale, no_inf
        opt.step()

    return step


def triton_step(params: list, groups: list, block: int, warps: int):
    """One hand-written Triton kernel a tensor (BLOCK elements a program, WARPS warps): the update of per_tensor_step,
    the clipping's scale read on the device, the step's scalars as fp32 arguments."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, scale_ptr, lr, wd, b1, b2, eps, bc1, bc2_sqrt, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, eviction_policy="evict_first") / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, mask=mask, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=mask, eviction_policy="evict_first")
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * wd) - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    moments = [(torch.zeros_like(q), torch.zeros_like(q)) for q in params]
    decay = {id(q) for q in groups[0]["params"]}
    bc1, bc2_sqrt = 1 - BETAS[0], (1 - BETAS[1]) ** 0.5  # step 1's

    def step(scale):
        for q, (m, v) in zip(params, moments):
            wd = WEIGHT_DECAY if id(q) in decay else 0.0
            grid = (triton.cdiv(q.numel(), block),)
            kernel[grid](q.data, q.grad, m, v, q.numel(), scale, LR, wd, *BETAS, EPS, bc1, bc2_sqrt, BLOCK=block,
                         num_warps=warps)  # fmt: skip

    return step


def compiled_foreach_step(params: list, groups: list):
    opt = torch.optim.AdamW(groups, lr=torch.tensor(LR), weight_decay=WEIGHT_DECAY, foreach=True, capturable=True)

    @torch.compile
    def step(scale):
        torch._foreach_div_([q.grad for q in params], scale)
        opt.step()

    return step


def as_dtensors(params: list) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=params[0].device)
    mesh = dist.init_device_mesh("cuda", (1,))
    out = []
    for q in params:
        d = torch.nn.Parameter(DTensor.from_local(q.data, mesh, [Shard(0)]))
        d.grad = DTensor.from_local(q.grad, mesh, [Shard(0)])
        out.append(d)
    return out


if __name__ == "__main__":
    main()
