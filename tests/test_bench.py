"""The benchmarks' own arithmetic, on CPU: what a benchmark times must be the work it names."""

import adamw_kernels  # bench/ (pytest's pythonpath)
import pytest
import torch


@pytest.mark.parametrize("variant", ["per-tensor", "compiled-foreach"])
def test_adamw_kernels_variants_make_the_step_of_trains_fused_adamw(variant, monkeypatch):
    """Each compiled AdamW that bench/adamw_kernels.py times against train.py's (torch's fused AdamW, the clipping in
    its grad_scale) makes the same first step, weight decay on the matrices only and the gradients divided by the
    scale: gradients near AdamW's eps make the division count, a learning rate of 1e-2 the decay."""
    monkeypatch.setattr(adamw_kernels, "LR", 1e-2)  # each step's decay, 1e-3 of a weight, far above fp32's rounding
    torch.manual_seed(0)
    start = [torch.randn(shape) * 0.02 for shape in [(48, 16), (16,), (80, 16)]]
    grads = [torch.randn_like(t) * 1e-8 for t in start]
    scale = torch.tensor(1.7)

    def params_and_groups():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        decay, rest = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
        return params, [{"params": decay}, {"params": rest, "weight_decay": 0.0}]

    reference, groups = params_and_groups()
    fused = torch.optim.AdamW(groups, lr=adamw_kernels.LR, weight_decay=adamw_kernels.WEIGHT_DECAY, fused=True)
    fused.grad_scale = scale
    fused.step()
    params, groups = params_and_groups()
    if variant == "per-tensor":
        step = adamw_kernels.per_tensor_step(params, groups)
    else:
        step = adamw_kernels.compiled_foreach_step(params, groups)
    step(scale)
    for p, r, t in zip(params, reference, start):
        expected = r.detach() - t
        assert expected.norm() > 0.1 * adamw_kernels.LR * expected.numel() ** 0.5  # the step moved it
        torch.testing.assert_close(p.detach() - t, expected, rtol=1e-4, atol=0)
