"""bench/adamw_triton.py's TritonAdamW (the adamw-triton lever): torch's fused AdamW until the moments exist, then its
update in one Triton kernel a tensor (on GPUs). Stepped beside torch's fused AdamW on the same weights and gradients,
as train.py's train_step steps it: the clipping's grad_scale, a non-finite step (found_inf: no update and the step
not counted), two groups (weight decay on one), a learning rate that changes every step, a tensor without a
gradient, an empty one, and sizes that are not multiples of the kernel's 1,024 elements. On CPU the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1, read when the kernel is built), which rounds to bf16 by truncation where
the GPU rounds to nearest: one bf16 unit apart there. On a GPU the same comparison runs as is, step() itself picking
the kernel."""

import pytest
import torch
from adamw_triton import TritonAdamW, adamw_kernel

SHAPES = [(37, 19), (1000,), (5, 3, 7), (2049,), (0,), (3, 1024), (11,)]  # the last: no gradient, ever
BAD_STEP = 4  # its gradients hold a NaN: the norm is not finite, and train_step sets found_inf
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel built anew in Triton's interpreter for the test, and again after it (a GPU's, for later tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    adamw_kernel.cache_clear()
    yield
    adamw_kernel.cache_clear()


def stepped_beside_torch(device: str, dtype: torch.dtype, steps: int = 6, call=TritonAdamW.step):
    """(ours, torch's): the two optimizers after `steps` steps. `call` steps ours from step 2 on (step 1, which makes
    the moments, is always step())."""
    torch.manual_seed(0)
    weights = [torch.randn(s, device=device).to(dtype) for s in SHAPES]
    made = []
    for make in (TritonAdamW, torch.optim.AdamW):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
        made.append(make(groups, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True))
    for step in range(1, steps + 1):
        grads = [torch.randn(s, device=device) * 10.0 ** -(2 * (i % 4)) for i, s in enumerate(SHAPES[:-1])]  # to eps
        if step == BAD_STEP:
            grads[1][7] = float("nan")
        for optimizer in made:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for p, g in zip(params, grads):
                p.grad = g.to(dtype, copy=True)  # torch's kernel writes the divided gradient back
            optimizer.grad_scale = torch.tensor(1.0 + step % 3, device=device)  # 1 (not clipped), 2, 3
            optimizer.found_inf = torch.tensor(float(step == BAD_STEP), device=device)
            (call if step > 1 and optimizer is made[0] else torch.optim.AdamW.step)(optimizer)
            for group in optimizer.param_groups:
                group["lr"] *= 0.7
    return made


def assert_same(ours, torch_s, steps: int, interpreted: bool = False) -> None:
    """Weights and moments as torch's fused AdamW leaves them, the steps counted alike (the NaN step not among them).
    fp32: within 1e-5 of each value and 1e-6 of the tensor's largest (the formulas round apart: torch's CPU kernel
    takes 1 - beta in double, its GPU kernel and this one fma(-beta, g, g); powers are exp2(t * log2(beta)) here).
    bf16: within one unit in the last place (8 bits of mantissa); in the interpreter, which truncates, against
    torch's CPU kernel, whose bf16 first moment cancels to other near-zero values, 99% of them and all within a
    unit of the largest."""
    pairs = zip(*[[p for group in o.param_groups for p in group["params"]] for o in (ours, torch_s)])
    for i, (a, b) in enumerate(pairs):
        assert (a in ours.state) == (b in torch_s.state) == (SHAPES[i] != (11,)), SHAPES[i]
        if b not in torch_s.state or SHAPES[i] == (0,):
            continue
        assert ours.state[a]["step"].item() == torch_s.state[b]["step"].item() == steps - (steps >= BAD_STEP)
        for name, x, y in [("weight", a, b)] + [(k, ours.state[a][k], torch_s.state[b][k]) for k in MOMENTS]:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            fp32, x, y = x.dtype == torch.float32, x.detach().float(), y.detach().float()
            apart, largest = (x - y).abs(), y.abs().max()
            within = apart <= (1e-5 * y.abs() + 1e-6 * largest if fp32 else 2.0**-7 * y.abs())
            what = f"{name} of {SHAPES[i]}: {apart.max().item():.3g} apart"
            if fp32 or not interpreted:
                assert within.all(), what
            else:
                assert within.float().mean() >= 0.99 and (apart <= 2.0**-7 * largest).all(), what
        assert a.float().isfinite().all(), SHAPES[i]  # the NaN step changed nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamws_triton_kernel_steps_as_torchs_fused_adamw_in_tritons_interpreter(dtype, interpreted):
    """fp32 over 6 steps; bf16 over one step of the kernel (step 2): truncation leaves it a unit apart."""
    steps = 6 if dtype == torch.float32 else 2
    ours, torch_s = stepped_beside_torch("cpu", dtype, steps, call=TritonAdamW.triton_step)
    assert_same(ours, torch_s, steps, interpreted=True)


def test_adamw_is_torchs_fused_adamw_on_cpu():
    """step() on CPU tensors is torch's fused AdamW itself: bit for bit."""
    ours, torch_s = stepped_beside_torch("cpu", torch.float32)
    for a, b in zip(*[[p for group in o.param_groups for p in group["params"]] for o in (ours, torch_s)]):
        assert torch.equal(a, b)


def test_adamws_triton_kernel_updates_fsdps_sharded_parameters_in_place(world_of_one, interpreted):
    """On FSDP2's parameters (DTensors; a gloo world of one here), each local shard, its gradient and moments go to the
    kernel, which updates them in place: two steps of a sharded Linear and LayerNorm, the second the kernel's, leave
    the weights of torch's fused AdamW on the same model (fp32, as assert_same)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    made, x = [], torch.randn(8, 16)
    for make in (TritonAdamW, torch.optim.AdamW):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)))
        made.append((model, make(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)))
    for step in (1, 2):
        if step == 2:
            after_step_1 = [p.to_local().clone() for p in made[0][0].parameters()]
        for model, optimizer in made:
            model(x * step).square().mean().backward()
            optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.5), torch.tensor(0.0)
            (TritonAdamW.triton_step if step == 2 and optimizer is made[0][1] else torch.optim.AdamW.step)(optimizer)
            optimizer.zero_grad(set_to_none=True)
    (ours_model, ours), (torch_model, torch_s) = made
    assert all(isinstance(p, DTensor) for p in ours_model.parameters())
    for a, b, before in zip(ours_model.parameters(), torch_model.parameters(), after_step_1):
        assert ours.state[a]["step"].item() == torch_s.state[b]["step"].item() == 2
        assert not torch.equal(a.to_local(), before)  # the kernel's step 2 moved each shard
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["closure", "amsgrad", "maximize", "tensor lr", "no grad_scale", "no found_inf"])
def test_adamw_steps_as_torch_where_the_kernel_does_not_apply(case, monkeypatch):
    """On a GPU (tensors that say they are on one here) step() takes torch's step for what the kernel does not do:
    a closure, amsgrad, maximize, a tensor learning rate, or no grad_scale or found_inf (a caller other than
    train_step); with none of these it takes the kernel."""
    w = torch.nn.Parameter(torch.ones(4))
    kind = {"amsgrad": True} if case == "amsgrad" else {"maximize": True} if case == "maximize" else {}
    lr = torch.tensor(1e-2) if case == "tensor lr" else 1e-2
    optimizer = TritonAdamW([w], lr=lr, fused=True, **kind)
    kernel_steps = []
    monkeypatch.setattr(TritonAdamW, "triton_step", lambda self: kernel_steps.append(1))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for _ in range(2):
        w.grad = torch.ones(4)
        optimizer.grad_scale = None if case == "no grad_scale" else torch.tensor(1.0)
        optimizer.found_inf = None if case == "no found_inf" else torch.tensor(0.0)
        optimizer.step((lambda: torch.tensor(0.0)) if case == "closure" else None)
    assert not kernel_steps and optimizer.state[w]["step"].item() == 2  # both steps torch's
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(0.0)
    for group in optimizer.param_groups:
        group.update(lr=1e-2, amsgrad=False, maximize=False)
    optimizer.step()
    assert kernel_steps == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamws_triton_kernel_steps_as_torchs_fused_adamw_on_the_gpu(dtype, monkeypatch):
    """step() takes the kernel from step 2 on CUDA, and leaves what torch's CUDA kernel leaves (its formulas)."""
    kernel_steps, triton_step = [], TritonAdamW.triton_step
    monkeypatch.setattr(TritonAdamW, "triton_step", lambda self: kernel_steps.append(1) or triton_step(self))
    steps = 6 if dtype == torch.float32 else 2
    ours, torch_s = stepped_beside_torch("cuda", dtype, steps)
    assert len(kernel_steps) == steps - 1  # step 1 makes the moments: torch's
    assert_same(ours, torch_s, steps)
