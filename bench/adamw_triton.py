"""BENCH: torch's fused AdamW with its GPU update in one hand-written Triton kernel a tensor (`bench.py ours --lever
adamw-triton`; `bench/adamw_kernels.py --variants adamw-triton`): what target 2 of issue 25 reads with it.

Why: train.py clips inside torch's fused kernel (its grad_scale), and that kernel then writes each divided gradient
back, 4 bytes a parameter that zero_grad frees at once; in torch builds whose multi_tensor_apply launches 320 blocks
at a time it also leaves the GPU part idle (docs/BENCHMARKS.md, thirty-first to thirty-fourth rounds). This kernel
reads the parameter, gradient and moments and writes the parameter and moments: 28 bytes a fp32 parameter.
Not in train.py: it is about 45 lines, and train.py is at its 2,100-line cap (the recipe issue's shape); on 8 ranks
of the 27B, where each rank updates an eighth of the parameters, it would save about 0.1% of a step.

The class keeps torch's AdamW whole (its state, its state_dict and so train.py's checkpoints, its CPU kernel, step 1
that makes the moments) and replaces only the GPU update from step 2, which it computes as torch's CUDA kernel does
in fp32, to within rounding: fma for the moments as there, but Triton's fast square root and division, and the bias
corrections' powers as exp2(t * log2(beta)) (with train.py's betas, 0.9 and 0.95, a few parts in a million of an
update at step 1, less later). train_step's grad_scale (the clipping's divisor) and found_inf (1: no update, the
step not counted) are read on the GPU, as torch's are; without them (or with amsgrad, maximize, a closure, or
tensor hyperparameters) a step is torch's.
tests/test_adamw_triton.py checks it against torch's fused AdamW: on CPU in Triton's interpreter, on a GPU as is."""

from functools import cache
from importlib.util import find_spec

import torch
from torch.distributed.tensor import DTensor


class TritonAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        """torch's step where the kernel does not apply: on CPU; at step 1, which makes the moments (a resume loads
        them); without train_step's grad_scale and found_inf; with amsgrad, maximize, a closure or tensor settings."""
        trained = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        on_gpu = all(p.is_cuda and p in self.state for p in trained) and find_spec("triton") is not None
        as_kernel = closure is None and all(
            not group["amsgrad"]
            and not group["maximize"]
            and all(isinstance(group[k], float) for k in ("lr", "eps"))
            and all(isinstance(beta, float) for beta in group["betas"])
            for group in self.param_groups
        )
        clipping = getattr(self, "grad_scale", None) is not None and getattr(self, "found_inf", None) is not None
        return self.triton_step() if on_gpu and as_kernel and clipping else super().step(closure)

    @torch.no_grad()
    def triton_step(self) -> None:
        trained = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        steps = [self.state[p]["step"] for p, _ in trained]  # fp32 on the device, as torch's fused AdamW keeps them
        torch._foreach_add_(steps, 1)
        for p, group in trained:
            state, hyper = self.state[p], (group["lr"], group["weight_decay"], *group["betas"], group["eps"])
            tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])  # this rank's shards, read as flat runs
            local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
            assert all(t.is_contiguous() for t in local), "TritonAdamW: a parameter or its state is not contiguous"
            grid, flags = (-(-local[0].numel() // 1024),), (state["step"], self.found_inf, self.grad_scale)
            adamw_kernel()[grid](*local, local[0].numel(), *flags, *hyper, BLOCK=1024)
        torch._foreach_sub_(steps, [self.found_inf] * len(steps))


@cache
def adamw_kernel():  # built at its first use, after TRITON_INTERPRET is read (the CPU tests set it)
    import triton
    import triton.language as tl

    @triton.jit
    def update(p, g, m, v, n, step, found_inf, grad_scale, lr, wd, beta1, beta2, eps, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = at < tl.where(tl.load(found_inf) == 0, n, 0)  # a non-finite gradient norm: nothing read or written
        grad = tl.load(g + at, live).to(tl.float32) / tl.load(grad_scale)  # clipped; not written back
        avg, avg_sq = tl.load(m + at, live).to(tl.float32), tl.load(v + at, live).to(tl.float32)
        w, t = tl.load(p + at, live).to(tl.float32), tl.load(step)  # t: the bias corrections' 1 - beta ** t
        avg = tl.fma(beta1, avg, tl.fma(-beta1, grad, grad))
        avg_sq = tl.fma(beta2, avg_sq, tl.fma(-beta2, grad * grad, grad * grad))
        denom = tl.sqrt(avg_sq) / tl.sqrt(1 - tl.exp2(t * tl.log2(beta2))) + eps
        w = w - lr * wd * w - lr / (1 - tl.exp2(t * tl.log2(beta1))) * avg / denom
        tl.store(p + at, w, live)  # each cast to its tensor's dtype
        tl.store(m + at, avg, live)
        tl.store(v + at, avg_sq, live)

    return update
