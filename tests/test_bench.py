"""The benchmarks' own arithmetic, on CPU: what a benchmark times must be the work it names."""

import math
import subprocess
import sys
from pathlib import Path

import adamw_kernels  # bench/ (pytest's pythonpath)
import pytest
import reduce_copy_in
import torch

ROOT = Path(__file__).resolve().parent.parent


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


def test_adamw_kernels_streams_variant_deals_every_parameter_once_in_its_group():
    """bench/adamw_kernels.py's fused-streams-K steps torch's fused AdamW over K buckets of the parameters: each
    parameter is in exactly one bucket, in a group with its own settings (weight decay), and the buckets' sizes are
    within the largest tensor of one another."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (900, 500, 400, 300, 300, 100, 7, 3)]
    groups = [{"params": params[:5]}, {"params": params[5:], "weight_decay": 0.0}]
    for k in (1, 2, 3):
        buckets = adamw_kernels.dealt(groups, k)
        placed = [(id(q), g.get("weight_decay")) for bucket in buckets for g in bucket for q in g["params"]]
        assert sorted(placed) == sorted((id(q), g.get("weight_decay")) for g in groups for q in g["params"]), k
        sizes = [sum(q.numel() for g in bucket for q in g["params"]) for bucket in buckets]
        assert len(buckets) == k and max(sizes) - min(sizes) <= 900, (k, sizes)


@pytest.fixture
def cpu_streams(monkeypatch):
    """Stand-ins for CUDA's stream calls, as a CPU run may make them: the streams' steps run one after another."""
    import contextlib

    class Stream:
        def wait_stream(self, other): ...

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def stepped(make_optimizer, scales: list[float]) -> tuple:
    """train.py's make_optimizer, or a lever's, over a tiny embedding, linear and norm model (the same weights and
    seeded gradients each call), one step a scale as train_step gives it (grad_scale, and found_inf where it is not
    finite): (the model, the optimizer, the weights after each step, each step's learning rates)."""
    import train

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    model.get_input_embeddings = lambda: model[0]
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in scales]
    optimizer, schedule = make_optimizer(model, train.Config(learning_rate=1e-2, warmup_steps=2), 10)
    weights, lrs = [], []
    for scale, step_grads in zip(scales, grads):
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        optimizer.grad_scale = torch.tensor(scale)  # train.py's clipping, through the fused kernel
        optimizer.found_inf = torch.tensor(float(not math.isfinite(scale)))
        optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
        lrs.append({g["lr"] for g in optimizer.param_groups})
        schedule.step()
    return model, optimizer, weights, lrs


@pytest.mark.parametrize("streams", [2, 3])
def test_adamw_streams_lever_regroups_and_steps_as_trains_adamw(streams, cpu_streams):
    """bench.py's adamw-streams lever rebuilds train.py's AdamW over 2 or 3 buckets: every parameter once, with its own
    group's weight decay, the same learning rate at every step of the schedule, and the same weights as train.py's
    optimizer after each of 4 steps: step 1 on the current stream (the moments made there), the later ones each
    bucket on its stream (CUDA's streams stand-ins here: the buckets' steps one after another on CPU)."""
    import bench
    import train

    model, ours, expected, expected_lrs = stepped(train.make_optimizer, [1.5] * 4)
    made = bench.with_optimizer_levers(train.make_optimizer, ["adamw-streams"], streams)  # --adamw-streams
    lever_model, lever, weights, lrs = stepped(made, [1.5] * 4)
    at, lever_at = ({id(p): i for i, p in enumerate(m.parameters())} for m in (model, lever_model))  # model order
    decay = {at[id(p)]: g["weight_decay"] for g in ours.param_groups for p in g["params"]}
    placed = sorted((lever_at[id(p)], g["weight_decay"], g["stream"]) for g in lever.param_groups for p in g["params"])
    assert [(i, wd) for i, wd, _ in placed] == sorted(decay.items()) and {s for *_, s in placed} == set(range(streams))
    assert lrs == expected_lrs and len({lr for step in lrs for lr in step}) == 4  # warmup, then decay
    for step, (ws, es) in enumerate(zip(weights, expected), 1):
        for w, e in zip(ws, es):
            torch.testing.assert_close(w, e, rtol=0, atol=0, msg=f"step {step}")


@pytest.mark.filterwarnings("error")  # e.g. the scheduler's: the rebuilt optimizer's step must be the one it wraps
def test_adamw_triton_lever_rebuilds_trains_adamw_as_triton_adamw(monkeypatch):
    """bench.py's adamw-triton lever rebuilds train.py's AdamW as bench/adamw_triton.py's TritonAdamW over the same
    groups (weight decay on each as train.py's) and schedule: on CPU, where it steps as torch's fused AdamW, the same
    weights and learning rates after each of 4 steps (a NaN's skip among them); with tensors that say they are on a
    GPU, its kernel from step 2 (tests/test_adamw_triton.py checks the kernel's update)."""
    from adamw_triton import TritonAdamW

    import bench
    import train

    made = bench.with_optimizer_levers(train.make_optimizer, ["adamw-triton"])
    model, ours, expected, expected_lrs = stepped(train.make_optimizer, [1.5, 1.0, math.nan, 2.0])
    _, lever, weights, lrs = stepped(made, [1.5, 1.0, math.nan, 2.0])
    assert type(lever) is TritonAdamW and all(g["fused"] for g in lever.param_groups)
    assert [g["weight_decay"] for g in lever.param_groups] == [g["weight_decay"] for g in ours.param_groups]
    assert lrs == expected_lrs and len({lr for step in lrs for lr in step}) == 4  # warmup, then decay
    for step, (ws, es) in enumerate(zip(weights, expected), 1):
        for w, e in zip(ws, es):
            torch.testing.assert_close(w, e, rtol=0, atol=0, msg=f"step {step}")
    kernel_steps = []
    monkeypatch.setattr(TritonAdamW, "triton_step", lambda self: kernel_steps.append(1))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    stepped(made, [1.5, 1.0, 2.0])
    assert len(kernel_steps) == 2
    for other in ("adamw-streams", "adamw-unclipped"):  # each would run torch's fused kernel, or none, unsaid
        with pytest.raises(SystemExit, match="does not combine"):
            bench.with_optimizer_levers(train.make_optimizer, ["adamw-triton", other])


@pytest.mark.filterwarnings("error")  # e.g. the scheduler's, were the lever's step not marked as its wrapper
@pytest.mark.parametrize(
    "levers", [["adamw-unclipped"], ["adamw-unclipped", "adamw-streams"], ["adamw-streams", "adamw-unclipped"]]
)
def test_adamw_unclipped_lever_gives_fused_adamw_no_grad_scale_on_a_step_the_norm_does_not_clip(
    levers, cpu_streams, monkeypatch
):
    """bench.py's adamw-unclipped lever hands fused AdamW no grad_scale on a step whose scale is 1 (its kernel then
    writes no gradient back), nor on a non-finite one (found_inf skips it), and train.py's scale on a clipped step:
    after each of 6 steps (scales 1, 2.5, 1, NaN's skip, inf's skip, 1) the weights are train.py's optimizer's, bit
    for bit; also over adamw-streams' optimizer, the levers applied as bench.py applies them, in either order."""
    import bench
    import train

    fused, scales_given = torch._fused_adamw_, []

    def spy(*args, grad_scale=None, **kwargs):
        scales_given.append(None if grad_scale is None else str(grad_scale.item()))  # str: NaN as "nan"
        return fused(*args, grad_scale=grad_scale, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    scales = [1.0, 2.5, 1.0, math.nan, math.inf, 1.0]
    *_, expected, _ = stepped(train.make_optimizer, scales)
    assert scales_given == [str(s) for s in scales for _ in range(2)]  # train.py's: a call per group
    scales_given[:] = []
    _, optimizer, weights, _ = stepped(bench.with_optimizer_levers(train.make_optimizer, levers), scales)
    calls = len(optimizer.param_groups)  # a call per group (the streams' 3 here), each step
    assert scales_given == [None] * calls + ["2.5"] * calls + [None] * 4 * calls
    for skipped in (3, 4):  # NaN's and inf's steps (found_inf)
        assert all(torch.equal(w, e) for w, e in zip(expected[skipped], expected[skipped - 1]))
    for step, (ws, es) in enumerate(zip(weights, expected), 1):
        for w, e in zip(ws, es):
            torch.testing.assert_close(w, e, rtol=0, atol=0, msg=f"step {step}")


def test_reduce_copy_in_times_copies_that_lay_out_fsdps_buffer_and_the_geometrys_units():
    """bench/reduce_copy_in.py's copies write what FSDP's torch._chunk_cat writes (each tensor's rows rank by rank,
    the last rank's padded with zeros) for tensors whose rows divide by the ranks and tensors whose rows do not, and
    its units are the geometry's: the root's embedding, norm and head, one layer of each kind."""
    torch.manual_seed(0)
    grads = [torch.randn(s, dtype=torch.bfloat16) for s in [(10, 6), (7,), (16, 3), (5, 2, 2)]]
    for ranks in (1, 3, 8):
        numel = sum(-(-g.shape[0] // ranks) * ranks * g[0].numel() for g in grads)
        fsdp, ours = torch.full((numel,), float("nan")), torch.full((numel,), float("nan"))
        torch._chunk_cat(grads, 0, ranks, out=fsdp.view(ranks, -1))
        reduce_copy_in.copy_in_by_copies(grads, ours, ranks)
        assert torch.equal(fsdp, ours) and ours.abs().sum() > 0, ranks
    units = reduce_copy_in.units(str(ROOT / "bench/configs/qwen3.8-27b-geometry-8layers"))
    assert list(units) == ["root", "layer 0 (linear_attention)", "layer 3 (full_attention)"]
    assert sorted(units["root"]) == [(5120,), (248320, 5120), (248320, 5120)]


def test_logsteps_weights_each_step_by_its_seconds_from_both_recipes_lines(tmp_path):
    """bench.py logsteps, for logs whose metrics.jsonl did not come back: train.py's lines give a rate (the block taken
    as full), trl_peer.py's their step's tokens and seconds; the rate over the chosen steps is tokens over seconds."""
    ours = [
        "step 1/4 | loss 13.4 | lr 9e-07 | grad 32.8 | 217 tok/s/gpu | 101 loss-tok/s/gpu | mfu 0.6% | mem 85.0 GiB",
        "step 2/4 | loss 13.5 | lr 1e-06 | grad 26.0 | 1,000 tok/s/gpu | 700 loss-tok/s/gpu | mfu 40.0% | mem 94 GiB",
        "bench: meminfo step 3: outside torch 1.29 GiB",
        "step 3/4 | loss 13.3 | lr 2e-06 | grad 27.1 | 4,000 tok/s/gpu | 3,000 loss-tok/s/gpu | mfu 60.0% | mem 99 GiB",
    ]
    trl = [
        "step 2/4 | loss 12.9 | 800 tokens, 500 loss tokens | 1.0 s | 800 tok/s/gpu | mfu 20.0% | mem 89.0 GiB",
        "step 3/4 | loss 12.8 | 600 tokens, 400 loss tokens | 0.5 s | 1,200 tok/s/gpu | mfu 30.0% | mem 89.0 GiB",
    ]
    results = []
    for name, lines in (("ours", ours), ("trl", trl)):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        command = [sys.executable, str(ROOT / "bench" / "bench.py"), "logsteps", str(tmp_path / name), "--seq-len"]
        proc = subprocess.run([*command, "1000", "--first", "2"], capture_output=True, text=True, check=True)
        results.append(proc.stdout.strip())
    # ours: 1 s and 0.25 s for two 1,000-token blocks; trl: 1,400 tokens in 1.5 s
    assert results[0] == "ours: steps 2-3 (2): 1,600 tok/s/GPU, MFU 44.0%", results[0]
    assert results[1] == "trl: steps 2-3 (2): 933 tok/s/GPU, MFU 23.3%", results[1]
    (tmp_path / "seed").write_text("BENCH seed tok_s_gpu=14750 s_step=1.111 steps=62 seq_len=16384 world=1\n")
    proc = subprocess.run([*command, "1000", "--first", "99"], capture_output=True, text=True)  # trl's: none chosen
    seed = subprocess.run([*command[:3], str(tmp_path / "seed"), "--seq-len", "1000"], capture_output=True, text=True)
    assert proc.returncode == seed.returncode == 1 and "no step line" in proc.stderr + seed.stderr, seed.stderr


def test_profile_names_each_kernels_module_or_autograd_node_and_fsdps_label_first():
    """bench.py profile's callers: a kernel launched in a forward is named by the innermost module around its launch
    (with_stack's nn.Module ranges, BENCH_PROFILE_STACK=1), one in the backward by the autograd node it runs for, and
    one inside FSDP's labels (within an autograd node's range, as its post-backward runs) by the label alone; each
    with the op that launched it."""
    import bench

    def launch(ts, tid, correlation):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": correlation}}  # fmt: skip

    events = [
        {"cat": "python_function", "name": "nn.Module: Qwen3_5DecoderLayer_3", "ts": 0, "dur": 100, "tid": 1},
        {"cat": "python_function", "name": "nn.Module: Qwen3_5Attention_1", "ts": 5, "dur": 50, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 10, "dur": 5, "tid": 1},
        launch(11, 1, 7),
        {"cat": "cpu_op", "name": "autograd::engine::evaluate_function: MulBackward0", "ts": 200, "dur": 50, "tid": 2},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 210, "dur": 5, "tid": 2},
        launch(211, 2, 8),
        {"cat": "cpu_op", "name": "autograd::engine::evaluate_function: PostBackward", "ts": 290, "dur": 70, "tid": 2},
        {"cat": "user_annotation", "name": "FSDP::post_backward_reduce", "ts": 300, "dur": 50, "tid": 2},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 310, "dur": 5, "tid": 2},
        launch(311, 2, 9),
    ]
    kernels = [({"name": "elementwise_kernel", "dur": 1000 * (n + 1), "args": {"correlation": c}}, "other")
               for n, c in enumerate((7, 8, 9))]  # fmt: skip
    assert [row["caller"] for row in bench.by_caller(events, kernels)] == [
        "FSDP::post_backward_reduce [other: elementwise_kernel]",
        "MulBackward0 / aten::mul [other: elementwise_kernel]",
        "Qwen3_5Attention / aten::mul [other: elementwise_kernel]",
    ]


def test_summary_means_each_repeated_kind_and_divides_ours_mean_by_the_seeds():
    """bench.py summary with BENCH_REPEAT: the runs of one kind and variant at one GPU count, geometry and block length
    are averaged (a run that failed left out), and ours' mean is divided by the seed's mean there; a kind run once,
    or at another block length, gets no mean."""
    import bench

    def run(kind, rate, seq_len=16384, **extra):
        variant = "seed" if kind == "seed" else "default"
        return {"kind": kind, "variant": variant, "gpus": 1, "layers": 8, "seq_len": seq_len, "tok_s_gpu": rate} | extra

    runs = [run("ours", 22000.0), run("seed", 15000.0), run("ours", 22400.0), run("seed", 14800.0)]
    runs += [run("ours", 1.0, error="exit status 1"), run("ours", 9000.0, seq_len=32768)]
    means = {m["kind"]: m for m in bench.means_of_repeats(runs)}
    assert means.keys() == {"ours", "seed"}
    assert means["ours"]["runs"] == 2 and means["ours"]["tok_s_gpu"] == 22200.0
    assert means["seed"]["tok_s_gpu"] == 14900.0
    assert means["ours"]["over_seed"] == 22200.0 / 14900.0 and "over_seed" not in means["seed"]


def test_blas_libraries_times_each_linear_shape_of_the_geometry_as_often_as_a_step_runs_it():
    """bench/blas_libraries.py sums each shape's time by its count in a step: its table must be the geometry's own
    linear layers (a repeated dict key would silently drop a count: its first form timed the out-projections 2 times
    a step instead of 8)."""
    import blas_libraries
    import transformers

    config = transformers.AutoConfig.from_pretrained(ROOT / "bench/configs/qwen3.8-27b-geometry-8layers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counts = {}
    for module in model.get_decoder().layers.modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.out_features, module.in_features)
            counts[shape] = counts.get(shape, 0) + 1
    assert blas_libraries.LINEAR_SHAPES == counts
    assert (blas_libraries.VOCAB, blas_libraries.HIDDEN) == tuple(model.get_output_embeddings().weight.shape)
