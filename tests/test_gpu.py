"""GPU tests: the packed path with the real kernels, in bf16, on small random-init models.

Kernels under test: PyTorch's varlen flash attention (`torch_varlen`), flash-linear-attention's chunked gated
delta rule with `cu_seqlens`, causal-conv1d with `seq_idx`. Models: a qwen3_5 hybrid with the layer pattern of
bench/configs/qwen3.8-27b-geometry-4layers (3 Gated DeltaNet layers, then 1 gated full-attention layer; the
full-attention heads keep head_dim 256, the rest is shrunk) and a dense Qwen3, both built as train.build_model
builds them (use_cache off on the config and text config, attention registered by train.resolve_attention).

Tolerance. Every comparison is per loss token. The reference spread is |bf16 alone - fp32 alone|: each example
run alone through an fp32 copy of the model with PyTorch-only kernels (sdpa, the reference gated delta rule and
convolution), i.e. the error bf16 itself makes. Packed and alone are both bf16 runs whose errors are of that
size, so |packed - alone| <= |packed - fp32| + |alone - fp32|: the test allows twice the spread (mean and max),
plus 1e-3 / 1e-2 nats of slack. A leaking block (the same tokens with one-sequence cu_seqlens and seq_idx) must
be clearly worse: max beyond the tolerance and mean at least 3x the packed mean. The Gated DeltaNet decay is set
to a long memory (A = 0.01 for all heads) so that a leaked recurrent state is visible in a random model: with
the default init most heads forget within a few tokens.

Assets: the tokenizer in $GPU_TEST_TOKENIZER, else .bench-assets/tok (when it holds tokenizer.json), else the
tiny tokenizer of tools/make_tiny_model.py; the conversations in $GPU_TEST_DATA, else data/ultrachat_sample.jsonl.
Numbers are printed (run with -s) and, with $GPU_TEST_REPORT set, appended to that file as JSON lines.
"""

import copy
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parent.parent
HYBRID_CONFIG = ROOT / "bench" / "configs" / "qwen3.8-27b-geometry-4layers"
N_EXAMPLES = 6


def report(name: str, **numbers) -> None:
    line = json.dumps({"test": name, **{k: round(v, 6) if isinstance(v, float) else v for k, v in numbers.items()}})
    print(line)
    if os.environ.get("GPU_TEST_REPORT"):
        with open(os.environ["GPU_TEST_REPORT"], "a") as f:
            f.write(line + "\n")


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    path = os.environ.get("GPU_TEST_TOKENIZER") or ROOT / ".bench-assets" / "tok"
    if Path(path, "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    from make_tiny_model import make_tokenizer  # pyproject.toml puts tools/ on the import path

    return make_tokenizer()


@pytest.fixture(scope="module")
def examples(tokenizer):
    path = Path(os.environ.get("GPU_TEST_DATA") or ROOT / "data" / "ultrachat_sample.jsonl")
    if not path.exists():
        pytest.skip(f"no conversations at {path}")
    masker = train.AssistantMasker(tokenizer)
    out = []
    for line in open(path):
        with suppress(train.Skip):  # a conversation the masker skips is no example
            out.append(masker(json.loads(line)["messages"]))
        if len(out) == N_EXAMPLES:
            return out
    pytest.skip(f"fewer than {N_EXAMPLES} trainable conversations in {path}")


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def hybrid_config(vocab_size: int):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(HYBRID_CONFIG)
    text = config.get_text_config()
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    shrink = dict(
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,  # head_dim stays 256, as in the real model
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        vocab_size=vocab_size,
        pad_token_id=text.pad_token_id if text.pad_token_id < vocab_size else None,  # tiny tokenizer: None
    )
    for key, value in shrink.items():
        setattr(text, key, value)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    return config


def dense_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )


def build(config, attn: str, device: torch.device):
    """The model train.build_model builds (class, attention, use_cache off, fp32), unsharded, with random weights."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = copy.deepcopy(config)
    attn = train.resolve_attention(attn, device) if attn == "torch_varlen" else attn
    train.require_kernels(config)
    config.use_cache = False
    config.get_text_config().use_cache = False
    image_text = type(config) in AutoModelForImageTextToText._model_mapping
    model_class = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    torch.manual_seed(0)
    return model_class.from_config(config, attn_implementation=attn, dtype=torch.float32)


def long_memory(model) -> None:
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data.fill_(math.log(0.01))


@contextmanager
def reference_kernels():
    """PyTorch-only gated delta rule and causal convolution (fp32-capable; correct for one sequence alone)."""
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5 as mq
    except ImportError:
        yield
        return
    saved = {name: getattr(mq, name) for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    try:
        for name, fn in saved.items():
            setattr(mq, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(mq, name, fn)


@pytest.fixture(scope="module")
def models(tokenizer, device):
    """{kind: (bf16 model with the real kernels, fp32 reference model with sdpa)}, built lazily."""
    built = {}

    def get(kind: str):
        if kind not in built:
            vocab_size = -(-len(tokenizer) // 64) * 64
            config = hybrid_config(vocab_size) if kind == "hybrid" else dense_config(vocab_size)
            fast = build(config, "torch_varlen", device)
            long_memory(fast)
            ref = build(config, "sdpa", device)
            ref.load_state_dict(fast.state_dict())
            built[kind] = (fast.to(device, torch.bfloat16).eval(), ref.to(device).eval())
        return built[kind]

    return get


def on(device, block: dict) -> dict:
    return train.to_device(block, device)


def packed_block(examples, pad: int) -> dict:
    return train.make_block(examples, sum(len(ids) for ids, _ in examples) + 37, pad)


def one_sequence(block: dict) -> dict:
    """The same tokens and reset positions, but cu_seqlens / seq_idx of one long sequence: nothing kept apart."""
    n = block["input_ids"].shape[1]
    return {
        **block,
        "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
        "max_length": n,
        "seq_idx": torch.zeros_like(block["seq_idx"]),
    }


def losses_with(model, block: dict, use_cache: bool = False, **overrides) -> torch.Tensor:
    """train.token_losses' forward with some of its arguments changed (use_cache, seq_idx=None, ...)."""
    kwargs = {**train.packed_inputs(block), "use_cache": use_cache, **overrides}
    hidden = model.model(**kwargs).last_hidden_state[0]
    targets = block["labels"][0, 1:]
    keep = targets != -100
    return F.cross_entropy(model.get_output_embeddings()(hidden[:-1][keep]).float(), targets[keep], reduction="none")


def alone_losses(model, examples, pad: int, device) -> torch.Tensor:
    blocks = [on(device, train.make_block([ex], len(ex[0]), pad)) for ex in examples]
    return torch.cat([train.token_losses(model, block) for block in blocks])


def stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.detach().float() - b.detach().float()).abs()
    return float(d.mean()), float(d.max())


def check_packed_equals_alone(kind, models, examples, tokenizer, device):
    fast, ref = models(kind)
    pad = pad_id(tokenizer)
    block = on(device, packed_block(examples, pad))
    with torch.no_grad():
        packed = train.token_losses(fast, block)
        alone = alone_losses(fast, examples, pad, device)
        with reference_kernels():
            exact = alone_losses(ref, examples, pad, device)
        leaked = train.token_losses(fast, on(device, one_sequence(packed_block(examples, pad))))
    assert packed.shape == alone.shape == exact.shape and packed.numel() == block["loss_tokens"]
    spread_mean, spread_max = stats(alone, exact)
    packed_mean, packed_max = stats(packed, alone)
    leak_mean, leak_max = stats(leaked, alone)
    tol_mean, tol_max = 2 * spread_mean + 1e-3, 2 * spread_max + 1e-2
    report(
        f"{kind}_packed_vs_alone",
        loss_tokens=packed.numel(),
        mean_loss=float(alone.mean()),
        fp32_spread_mean=spread_mean,
        fp32_spread_max=spread_max,
        packed_mean=packed_mean,
        packed_max=packed_max,
        tol_mean=tol_mean,
        tol_max=tol_max,
        one_sequence_leak_mean=leak_mean,
        one_sequence_leak_max=leak_max,
    )
    assert torch.isfinite(packed).all()
    assert packed_mean <= tol_mean and packed_max <= tol_max
    assert leak_max > tol_max and leak_mean >= 3 * packed_mean, "a block without its packing signals should leak"


def test_hybrid_packed_per_token_losses_equal_each_example_alone(models, examples, tokenizer, device):
    check_packed_equals_alone("hybrid", models, examples, tokenizer, device)


def test_dense_packed_per_token_losses_equal_each_example_alone(models, examples, tokenizer, device):
    check_packed_equals_alone("dense", models, examples, tokenizer, device)


@torch.no_grad()
def test_hybrid_leak_variants(models, examples, tokenizer, device):
    """Which signal keeps what apart. Measured and reported; asserted only where the answer is certain."""
    fast, _ = models("hybrid")
    pad = pad_id(tokenizer)
    block = on(device, packed_block(examples, pad))
    alone = alone_losses(fast, examples, pad, device)
    packed = losses_with(fast, block)
    variants = {
        "no_seq_idx": losses_with(fast, block, seq_idx=None),  # the convolution reads across boundaries
        "use_cache": losses_with(fast, block, use_cache=True),  # a cache built during the forward
        "one_sequence": losses_with(fast, on(device, one_sequence(block))),  # nothing kept apart
    }
    base_mean, base_max = stats(packed, alone)
    numbers = {"packed_mean": base_mean, "packed_max": base_max}
    for name, losses in variants.items():
        numbers[f"{name}_mean"], numbers[f"{name}_max"] = stats(losses, alone)
    report("hybrid_leak_variants", **numbers)
    assert numbers["one_sequence_mean"] > 3 * base_mean


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_token_losses_equal_plain_cross_entropy_over_full_logits(kind, compiled, models, examples, tokenizer, device):
    """The chunked, loss-positions-only LM head (chunk 7, so many chunks) against the model's own forward with
    full logits and F.cross_entropy, on the packed block in bf16: values and gradients; its softmax gradient eager,
    and compiled as build_model compiles it."""
    fast, _ = models(kind)
    block = on(device, packed_block(examples, pad_id(tokenizer)))
    fast.zero_grad(set_to_none=True)
    if compiled:
        fast.compiled_softmax_gradient = torch.compile(train.softmax_gradient, dynamic=True)
    chunked = train.token_losses(fast, block, chunk_tokens=7)
    if compiled:
        del fast.compiled_softmax_gradient
    logits = fast(**train.packed_inputs(block)).logits
    targets = block["labels"][0, 1:]
    keep = targets != -100
    plain = F.cross_entropy(logits[0, :-1][keep].float(), targets[keep], reduction="none")
    mean, worst = stats(chunked, plain)
    name = f"{kind}{'_compiled' if compiled else ''}_token_losses_vs_full_logits"
    report(name, loss_mean_abs=mean, loss_max_abs=worst)
    assert chunked.shape == plain.shape
    assert mean <= 5e-3 and worst <= 5e-2  # one bf16 rounding of the logits, from differently shaped matmuls
    chunked.sum().backward()
    grads = {n: p.grad.float().clone() for n, p in fast.named_parameters() if p.grad is not None}
    fast.zero_grad(set_to_none=True)
    plain.sum().backward()
    total = sum(float(p.grad.float().norm() ** 2) for p in fast.parameters() if p.grad is not None) ** 0.5
    diff = sum(float((grads[n] - p.grad.float()).norm() ** 2) for n, p in fast.named_parameters() if n in grads) ** 0.5
    missing = [n for n, p in fast.named_parameters() if p.grad is not None and n not in grads]
    fast.zero_grad(set_to_none=True)
    report(f"{name}_grads", grad_rel_err=diff / total)
    assert not missing and diff <= 0.1 * total  # bf16 noise is a few %; a wrong shift or a lost chunk is O(1)


def test_hybrid_gradients_against_fp32_reference(models, examples, tokenizer, device):
    """bf16 gradients with the real kernels against the fp32 reference (PyTorch kernels), one example alone, per
    group of parameters. On Hopper with Triton < 3.7.1 fla's guard stays on: the Gated DeltaNet backward runs
    through its TileLang kernel (workload.yaml's node setup installs tilelang there), and the run stops at start
    without it (test_hopper_without_tilelang_stops_at_start)."""
    fast, ref = models("hybrid")
    block = on(device, train.make_block([examples[0]], len(examples[0][0]), pad_id(tokenizer)))
    import fla.ops.common.chunk_o as guard

    guarded = guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1
    for model in (fast, ref):
        model.zero_grad(set_to_none=True)
    train.token_losses(fast, block).sum().backward()
    with reference_kernels():
        train.token_losses(ref, block).sum().backward()
    groups = {"linear_attn": [], "self_attn": [], "mlp": [], "other": []}
    fast_params = dict(fast.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        group = next((g for g in groups if f".{g}." in name), "other")
        groups[group].append((fast_params[name].grad.float(), p.grad))
    errors = {}
    for group, pairs in groups.items():
        if pairs:
            diff = sum(float((a - b).norm() ** 2) for a, b in pairs) ** 0.5
            errors[group] = diff / max(sum(float(b.norm() ** 2) for _, b in pairs) ** 0.5, 1e-30)
    for model in (fast, ref):
        model.zero_grad(set_to_none=True)
    report("hybrid_grads_vs_fp32", tilelang_backward=guarded, **{f"{g}_rel_err": e for g, e in errors.items()})
    baseline = max(errors["mlp"], errors["self_attn"])
    assert errors["linear_attn"] <= max(3 * baseline, 0.05), errors


def test_hopper_without_tilelang_stops_at_start(tmp_path):
    """Where fla would refuse the backward (Hopper, Triton >= 3.4, < 3.7.1) and its TileLang backend is off,
    train.require_kernels stops before anything loads, saying what to install. FLA_TILELANG=0 switches the
    backend off in a fresh process (fla caches the choice)."""
    import fla.ops.common.chunk_o as guard
    from transformers import AutoConfig

    if not (guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1):
        pytest.skip("fla has no Hopper guard on this GPU and Triton")
    check = (
        "import sys, train; from transformers import AutoConfig; "
        f"train.require_kernels(AutoConfig.from_pretrained({str(HYBRID_CONFIG)!r}))"
    )
    env = {**os.environ, "FLA_TILELANG": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "install tilelang" in proc.stderr, proc.stderr[-2000:]
    train.require_kernels(AutoConfig.from_pretrained(HYBRID_CONFIG))  # this process: tilelang and nvcc, no error


def test_compiled_norms_and_mlp_equal_eager(models, examples, tokenizer, device):
    """train.compile_elementwise (the `compile` setting) against the eager model on the packed block in bf16:
    per-token losses and gradients (both sides run the same Gated DeltaNet kernels, so only the compiled norms and
    MLPs can differ)."""
    fast, _ = models("hybrid")
    compiled = copy.deepcopy(fast)
    train.compile_elementwise(compiled.get_decoder().layers)
    block = on(device, packed_block(examples, pad_id(tokenizer)))
    losses, grads = {}, {}
    for name, model in (("eager", fast), ("compiled", compiled)):
        model.zero_grad(set_to_none=True)
        losses[name] = train.token_losses(model, block)
        losses[name].sum().backward()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    mean, worst = stats(losses["compiled"], losses["eager"])
    total = sum(float(g.norm() ** 2) for g in grads["eager"].values()) ** 0.5
    diff = sum(float((grads["compiled"][n] - g).norm() ** 2) for n, g in grads["eager"].items()) ** 0.5
    compiled_modules = sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.modules())
    report("compiled_vs_eager", loss_mean_abs=mean, loss_max_abs=worst, grad_rel_err=diff / total)
    assert compiled_modules == 4 * 3 + 3 + 2  # per layer 2 norms and the MLP; 3 GDN gated norms; q/k norms
    assert grads["compiled"].keys() == grads["eager"].keys()
    # The compiled kernels round bf16 intermediates at other points than eager: differences of the size of bf16 vs
    # fp32 (docs/BENCHMARKS.md has the measured spread), while a wrong fusion would be O(1).
    assert mean <= 1e-2 and worst <= 1e-1 and diff <= 0.05 * total


def test_adamw_moments_in_pinned_host_memory_free_the_gpu_and_step_exactly_as_kept(device):
    """HostMoments on CUDA: pinned buffers, the copies out on a side stream. While away, the moments' GPU memory is
    free (memory_allocated falls by their bytes) and what the forward allocates there (here: NaN-filled tensors of
    the same sizes, at once) cannot reach the copies; three fused-AdamW steps match the same steps kept."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048))
    inputs = [torch.randn(64, 2048, device=device) for _ in range(3)]

    def three_steps(away: bool):
        model = copy.deepcopy(reference).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        moments, freed = train.HostMoments(optimizer, device) if away else None, []
        for x in inputs:
            if moments:
                before = torch.cuda.memory_allocated()
                moments.to_host()
                freed.append(before - torch.cuda.memory_allocated())
                scratch = [torch.full(b.shape, float("nan"), device=device) for b in moments.buffers]
                del scratch
            model(x).square().mean().backward()
            if moments:
                moments.to_device()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = [m.clone() for m in train.HostMoments(optimizer, device).moments()]
        return [p.detach().clone() for p in model.parameters()] + state, freed

    (kept, _), (away, freed) = three_steps(False), three_steps(True)
    nbytes = 2 * sum(p.nbytes for p in reference.parameters())
    assert freed == [0, nbytes, nbytes]  # step 1 had no moments yet
    assert len(kept) == len(away) == 3 * len(list(reference.parameters()))  # weights and two moments each
    assert all(a.equal(b) for a, b in zip(kept, away))
    report("host_moments", moments_mib=nbytes / 2**20)


COMPILES_RUN = """
import json, sys, threading, time
import triton.compiler
from triton.runtime.autotuner import Autotuner
import train

if sys.argv[2] == "one at a time":  # the recipe without the lever, for the time it saves
    train.compile_autotuned_kernels_at_once = lambda: None
compiles, timing, compile, bench = [], [], triton.compiler.compile, Autotuner._bench
def recorded(*args, **kwargs):  # a configuration compiled: on which thread, and inside a timing or not
    compiles.append((threading.current_thread().name, bool(timing)))
    return compile(*args, **kwargs)
def timed(self, *args, **kwargs):
    timing.append(1)
    try:
        return bench(self, *args, **kwargs)
    finally:
        timing.pop()
triton.compiler.compile, Autotuner._bench = recorded, timed
t0 = time.perf_counter()
result = train.train(sys.argv[1])
print("COMPILES " + json.dumps({"compiles": compiles, "seconds": time.perf_counter() - t0, **result}))
"""


def test_autotuned_kernels_are_compiled_by_threads_before_they_are_timed(tmp_path, tokenizer):
    """compile_autotuned_kernels_at_once, on an empty Triton cache (train.train, the tiny hybrid, in a new process):
    each autotuned fla kernel's configurations are compiled by a pool of threads before the autotuner times them, so
    no configuration compiles inside a timing; without it, every one does (and the run takes longer: reported). fla's
    Hopper guard is lifted as the bench does (bench/site): this checks where kernels compile, not the gradients."""
    vocab_size = -(-len(tokenizer) // 64) * 64
    hybrid_config(vocab_size).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    settings = dict(model_name=str(tmp_path / "model"), model_revision="", init="random", max_steps=1, log_every=1)
    settings |= dict(dataset_name=str(ROOT / "data" / "ultrachat_sample.jsonl"), max_seq_len=4096, compile=False)
    settings |= dict(attn_implementation="torch_varlen", save_every=-1, export=False, output_dir=str(tmp_path / "o"))
    (tmp_path / "job.yaml").write_text(json.dumps(settings))
    (tmp_path / "run.py").write_text(COMPILES_RUN)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "site"), str(ROOT), *sys.path])
    runs = {}
    for way in ("at once", "one at a time"):
        shutil.rmtree(tmp_path / "o", ignore_errors=True)
        env["TRITON_CACHE_DIR"] = str(tmp_path / way.replace(" ", "_"))  # empty: a new machine
        cmd = [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "job.yaml"), way]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[way] = json.loads(proc.stdout.split("COMPILES ", 1)[1].splitlines()[0])
        assert math.isfinite(runs[way]["final_loss"])
    threads = Counter(name for name, _ in runs["at once"]["compiles"] if name != "MainThread")
    inside = {way: sum(in_timing for _, in_timing in run["compiles"]) for way, run in runs.items()}
    report(
        "compile_at_once",
        threads=len(threads),
        pooled=sum(threads.values()),
        inside_timings=inside,
        seconds={way: round(run["seconds"], 1) for way, run in runs.items()},
    )
    assert len(threads) > 1 and sum(threads.values()) > 10  # many configurations, on several threads
    assert inside == {"at once": 0, "one at a time": sum(threads.values())}, inside


def train_in_a_new_process(tmp_path, script: str, config, tokenizer, **settings) -> subprocess.CompletedProcess:
    """script, which calls train.train(sys.argv[1]), run with python on config's model (random weights) and the
    sample data at 2,048-token blocks, a log line every step, no checkpoint (settings may change each); it must
    succeed."""
    config.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    defaults = dict(model_name=str(tmp_path / "model"), init="random", log_every=1, compile=False, save_every=-1)
    defaults |= dict(dataset_name=str(ROOT / "data" / "ultrachat_sample.jsonl"), max_seq_len=2048)
    settings = defaults | dict(attn_implementation="torch_varlen", output_dir=str(tmp_path / "o")) | settings
    (tmp_path / "job.yaml").write_text(json.dumps(settings))
    (tmp_path / "run.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    cmd = [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "job.yaml")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


NON_FINITE_RUN = """
import json, sys
import train

def nan_at_step_2(step, model, loss_sum, blocks):  # a NaN in one gradient, as an overflow would leave
    if step == 2:
        next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("nan")

print("RESULT " + json.dumps(train.train(sys.argv[1], step_hook=nan_at_step_2)))
"""


def test_a_non_finite_step_is_skipped_by_fused_adamw_on_the_gpu(tmp_path, tokenizer):
    """train_step dispatches AdamW before it reads the gradient norm: on CUDA (FSDP2's DTensors, fused AdamW's CUDA
    kernel) a NaN gradient at step 2 must leave no NaN in the weights, the step counted as skipped, its window's loss
    nan and the others finite (train.train on a tiny dense model, in a new process)."""
    config = dense_config(-(-len(tokenizer) // 64) * 64)
    proc = train_in_a_new_process(tmp_path, NON_FINITE_RUN, config, tokenizer, max_steps=4)
    assert "step 2: non-finite loss or gradient norm, optimizer step skipped (1 in a row, 1 in all)" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4] and steps[4]["bad_steps"] == 1
    assert [s for s, r in steps.items() if not math.isfinite(r["loss"])] == [2]
    from safetensors.torch import load_file

    weights = [t for f in sorted((tmp_path / "o" / "model").glob("*.safetensors")) for t in load_file(f).values()]
    assert weights and all(torch.isfinite(t).all() for t in weights)
    report("non_finite_step_skipped", steps=len(steps), tensors=len(weights))


AHEAD_RUN = """
import json, sys
import torch
import train

busy, log_after_step = [], train.MetricsLog.after_step

def after_step_then_look(self, job, stats):  # after the step and its log line (log_every: 1): is AdamW still queued?
    log_after_step(self, job, stats)
    busy.append(not torch.cuda.current_stream().query())

train.MetricsLog.after_step = after_step_then_look
result = train.train(sys.argv[1])
print("RESULT " + json.dumps({**result, "busy": busy}))
"""


def test_the_host_queues_the_next_step_while_the_gpu_runs_adamw(tmp_path, tokenizer):
    """A step's only wait for the GPU is for its gradient norm and loss, copied before AdamW's kernels: after each
    step and its log line (every step here) AdamW is still running, so the next step's counts, flags and first
    kernels are queued behind it and the GPU does not idle between steps. train.train on a dense model whose AdamW
    (about 1.2 B fp32 parameters: ~10 ms) outlasts the host's work after it; auto's probe off (it syncs in its first
    steps), in a new process."""
    config = dense_config(-(-len(tokenizer) // 64) * 64)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 2048, 8192, 16
    proc = train_in_a_new_process(tmp_path, AHEAD_RUN, config, tokenizer, max_steps=6, activation_checkpointing="0")
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    report("host_ahead_of_adamw", busy=result["busy"])
    assert result["steps"] == 6 and result["busy"][1:] == [True] * 5, result


ONE_RANK_RUN = """
import json, sys
import torch
import train

streams, record_stream = [], torch.Tensor.record_stream

def recorded(self, stream):  # OneRankReduce's calls: on which stream FSDP may still read the buffer it hands back
    caller = sys._getframe(1)
    if caller.f_code.co_name == "allocate":  # called by FSDP's foreach_reduce, which names its reduce stream
        streams.append(stream == caller.f_back.f_locals["reduce_scatter_stream"] != torch.cuda.default_stream())
    return record_stream(self, stream)

torch.Tensor.record_stream = recorded
result = train.train(sys.argv[1])
print("RESULT " + json.dumps({**result, "streams": streams}))
"""


@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_one_rank_reduce_marks_its_buffer_as_used_on_fsdps_reduce_stream(tmp_path, tokenizer, master_dtype):
    """On one GPU FSDP adds a block's gradients to the last block's (gradient accumulation), or casts them to bf16
    weights' dtype, on its reduce stream after it has let go of the buffer OneRankReduce handed back as its output:
    the buffer is marked as used on that stream (record_stream), so that the allocator does not give it to the compute
    stream before those kernels ran. Each of the 3 modules' reduces, at each of 2 blocks of 3 steps, marks it on
    FSDP's reduce stream (foreach_reduce's reduce_scatter_stream, not the default stream), and the run's loss is
    finite (train.train on a tiny dense model)."""
    config = dense_config(-(-len(tokenizer) // 64) * 64)
    settings = dict(max_steps=3, gradient_accumulation_steps=2, activation_checkpointing="0", master_dtype=master_dtype)
    proc = train_in_a_new_process(tmp_path, ONE_RANK_RUN, config, tokenizer, **settings)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    report("one_rank_reduce_streams", master_dtype=master_dtype, marked=len(result["streams"]))
    assert result["steps"] == 3 and math.isfinite(result["final_loss"]), result
    assert result["streams"] == [True] * (3 * 2 * 3), result["streams"]  # (2 layers + the root) x 2 blocks x 3 steps


MOMENTS_RUN = """
import json, sys
import torch
import train

seen, probe_after_step = {}, train.RecomputeProbe.after_step

def capped_at_step_1(self, job, stats):  # before the probe's rule: the GPU capped between its sum and the old rule's
    if not seen:
        moments = sum(m.nbytes for m in job.host_moments.moments())
        seen.update(before=job.host_moments.peak, after=torch.cuda.max_memory_allocated(), moments=moments)
        seen["cap"] = (seen["before"] + moments + (seen["after"] - seen["before"]) / 2) / 0.98  # auto keeps 2% spare
        torch.cuda.set_per_process_memory_fraction(seen["cap"] / torch.cuda.get_device_properties(0).total_memory)
    probe_after_step(self, job, stats)
    seen.setdefault("kept", job.host_moments is None)

train.RecomputeProbe.after_step = capped_at_step_1
result = train.train(sys.argv[1], step_hook=None)
print("RESULT " + json.dumps({**result, **seen}))
"""

NAN_AT_STEP_1 = """
def nan_at_step_1(step, model, loss_sum, blocks):  # a NaN in one gradient: AdamW skips its update, makes the moments
    if step == 1:
        next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("nan")

"""


def moments_config(tokenizer):
    """The moments tests' dense model: 4 layers, hidden 2048, about 1.3 B fp32 parameters (most in its embedding and
    head, at the Qwen3.5 tokenizer's vocabulary), whose AdamW step peaks well above its backward at 2,048 tokens."""
    config = dense_config(-(-len(tokenizer) // 64) * 64)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 2048, 8192, 16
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    return config


@pytest.mark.parametrize("non_finite_step_1", [False, True])
def test_auto_keeps_adamws_moments_where_they_fit_beside_the_forward_and_backward(
    tmp_path, tokenizer, non_finite_step_1
):
    """auto's rule after step 1 (RecomputeProbe): AdamW's moments stay on the GPU where step 1's forward and backward
    peak plus the moments fits, even where the peak that AdamW's step (which makes them) leaves behind would not: that
    one holds the moments already. A dense model of about 1.3 B fp32 parameters at 2,048-token blocks, whose AdamW step
    peaks well above its backward: the GPU is capped (the per-process fraction, which auto reads) so that the 98% auto
    compares with falls halfway between the two rules' sums, before the probe decides. The moments stay, and 3 more
    steps run under the cap. A non-finite step 1 (fused AdamW's found_inf) counts as any other: it made the moments,
    so a rule that waited for step 2 would read a peak that holds them and move them."""
    config = moments_config(tokenizer)
    script = MOMENTS_RUN
    if non_finite_step_1:
        assert script.count("result = train.train(sys.argv[1], step_hook=None)") == 1
        script = script.replace("result = train.train", NAN_AT_STEP_1 + "result = train.train")
        script = script.replace("step_hook=None", "step_hook=nan_at_step_1")
    proc = train_in_a_new_process(tmp_path, script, config, tokenizer, max_steps=4, export=False)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    gib = {k: result[k] / 2**30 for k in ("before", "after", "moments", "cap")}
    report("moments_rule", **gib, kept=result["kept"], non_finite_step_1=non_finite_step_1)
    skipped = "step 1: non-finite loss or gradient norm, optimizer step skipped (1 in a row, 1 in all)"
    assert (skipped in proc.stdout) == non_finite_step_1, proc.stdout[-2000:]
    assert result["after"] - result["before"] > 2**30  # AdamW's step peaks above the backward: the cap between
    assert result["kept"] and "leave the GPU" not in proc.stdout, proc.stdout[-2000:]
    assert result["steps"] == 4 and math.isfinite(result["final_loss"]), result


def test_a_resume_decides_on_its_first_steps_peak_without_the_moments_it_loaded(tmp_path, tokenizer):
    """auto's rule in a resumed process: its first step's peak before AdamW is that step's, not the load's (HostMoments
    frees the loaded moments, then restarts CUDA's peak, before the step's forward), so it stays within a quarter of
    the moments of a fresh run's (13.5 GiB against 14.4 on an H100 and an H200; on the H100 18.7 without the restart,
    the load's weights twice and the moments), and the moments stay on the GPU under a cap between the two rules' sums.
    Here the loaded weights and moments alone (14.0 GiB) come within a block's activations of a step's peak, so the
    order of the free and the restart is tests/test_model.py's to check. The moments_config model: 2 steps saved at
    their end, then the same command resumed to step 4, each run in a new process."""
    config = moments_config(tokenizer)
    runs = []
    for steps, save_every in ((2, 0), (4, -1)):
        proc = train_in_a_new_process(
            tmp_path, MOMENTS_RUN, config, tokenizer, max_steps=steps, save_every=save_every, export=False
        )
        runs.append((json.loads(proc.stdout.split("RESULT ", 1)[1]), proc.stdout))
    (fresh, _), (resumed, log) = runs
    gib = {
        f"{k}_{run}": r[k] / 2**30 for run, r in (("fresh", fresh), ("resumed", resumed)) for k in ("before", "moments")
    }
    report("moments_rule_resumed", **gib, kept=resumed["kept"])
    assert "resumed from" in log and resumed["steps"] == 4, log[-2000:]
    assert resumed["before"] < fresh["before"] + fresh["moments"] / 4, (fresh, resumed)  # not the loaded ones
    assert resumed["kept"] and "leave the GPU" not in log and math.isfinite(resumed["final_loss"]), log[-2000:]
