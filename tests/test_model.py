"""The model path on a tiny dense model in fp32: packed equals separate, the chunked loss equals plain CE."""

import contextlib
import copy
import ctypes
import itertools
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import train

PARTS = ["self_attn", "mlp"]  # the tiny dense model's recomputable parts, in order


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    config = train.model_config(tiny_model_dir)  # use_cache off, as the recipe sets it
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def examples(tokenizer, conversations):
    masker = train.AssistantMasker(tokenizer)
    return [masker(c) for c in conversations[:4]]


def plain_losses(model, block, use_cache=False):
    """Full-vocabulary logits and F.cross_entropy, the way a textbook would (and a cache, when asked)."""
    logits = model(input_ids=block["input_ids"], position_ids=block["position_ids"], use_cache=use_cache).logits
    targets = block["labels"][0, 1:]
    keep = targets != -100
    return F.cross_entropy(logits[0, :-1][keep].float(), targets[keep], reduction="none")


def separate_losses(model, examples, pad_id, loss_fn):
    return torch.cat([loss_fn(model, train.make_block([ex], len(ex[0]), pad_id)) for ex in examples])


def max_rel_err(a, b):
    return float(((a - b).abs() / b.abs().clamp_min(1e-6)).max())


def packed_block(examples, pad_id):
    return train.make_block(examples, sum(len(ids) for ids, _ in examples) + 37, pad_id)


@torch.no_grad()
def test_packed_per_token_losses_equal_each_example_alone(model, examples, tokenizer):
    block = packed_block(examples, tokenizer.pad_token_id)
    packed = train.token_losses(model, block)
    alone = separate_losses(model, examples, tokenizer.pad_token_id, train.token_losses)
    assert packed.shape == alone.shape and packed.numel() == block["loss_tokens"]
    assert max_rel_err(packed, alone) <= 1e-5


def assert_head_loss_matches_full_logits(model, block):
    """token_losses (HeadLoss, chunk 7: many chunks, a short last one) against autograd through the model's own
    full logits and F.cross_entropy, each scaled as a training step scales its loss: the losses and every
    parameter's gradient, in fp32."""
    targets = block["labels"][0, 1:]
    grads = {}
    for name in ("fused", "plain"):
        model.zero_grad(set_to_none=True)
        if name == "fused":
            losses = train.token_losses(model, block, chunk_tokens=7, loss_weight=0.37)
        else:
            logits = model(**train.packed_inputs(block)).logits[0, :-1][targets != -100]
            losses = F.cross_entropy(logits.float(), targets[targets != -100], reduction="none")
        (losses.sum() * 0.37).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        grads[name]["losses"] = losses.detach()
    model.zero_grad(set_to_none=True)
    assert grads["fused"].keys() == grads["plain"].keys() == {*dict(model.named_parameters()), "losses"}
    for n, plain in grads["plain"].items():
        assert (grads["fused"][n] - plain).norm() <= 1e-5 * plain.norm(), n


def test_head_loss_gradients_equal_autograd_through_full_logits(model, examples, tokenizer):
    """HeadLoss computes the head's and the hidden states' gradients in its forward, on a packed block."""
    assert_head_loss_matches_full_logits(model, packed_block(examples, tokenizer.pad_token_id))


def test_head_loss_refuses_a_backward_whose_losses_weigh_other_than_its_loss_weight(model, examples, tokenizer):
    """HeadLoss scales its gradients by loss_weight in the forward: a backward that weighs the losses otherwise (or
    each differently) would train on wrong gradients, and stops instead; the weight given passes."""
    block = packed_block(examples, tokenizer.pad_token_id)
    for weigh in (lambda losses: losses.sum() * 0.5, lambda losses: (losses * torch.rand_like(losses)).sum()):
        with pytest.raises(RuntimeError, match="weighs not loss_weight"):
            weigh(train.token_losses(model, block, loss_weight=0.25)).backward()
    (train.token_losses(model, block, loss_weight=0.5).sum() * 0.5).backward()
    model.zero_grad(set_to_none=True)


def test_head_loss_with_tied_embeddings_sums_both_uses_of_the_weight():
    """A model whose LM head is its embedding matrix (a fresh 2-layer model): the head's gradient from HeadLoss
    and the embedding's from the input side add up to autograd's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 300, (50,)).tolist()
    assert_head_loss_matches_full_logits(model, train.make_block([(ids, [False] * 10 + [True] * 40)], 50, pad_id=0))


@torch.no_grad()
def test_packing_leaks_without_reset_positions(model, examples, tokenizer):
    block = packed_block(examples, tokenizer.pad_token_id)
    block["position_ids"] = torch.arange(block["input_ids"].shape[1])[None]  # one long sequence
    leaked = train.token_losses(model, block)
    alone = separate_losses(model, examples, tokenizer.pad_token_id, train.token_losses)
    assert max_rel_err(leaked, alone) > 1e-2


@torch.no_grad()
def test_packing_leaks_with_the_cache_on(model, examples, tokenizer):
    block = packed_block(examples, tokenizer.pad_token_id)
    alone = separate_losses(model, examples, tokenizer.pad_token_id, plain_losses)
    assert max_rel_err(plain_losses(model, block, use_cache=False), alone) <= 1e-5
    assert max_rel_err(plain_losses(model, block, use_cache=True), alone) > 1e-2


def test_every_signal_that_keeps_packed_conversations_apart_reaches_the_model(model, examples, tokenizer):
    """What token_losses hands the decoder for a packed block: position_ids (sdpa's block mask, rotary positions),
    cu_seq_lens_* and max_length_* (varlen attention, the gated delta rule), seq_idx (causal-conv1d), the cache
    off. The CPU model reads position_ids only; the hybrids' kernels read the rest (tests/test_gpu.py)."""
    block = packed_block(examples, tokenizer.pad_token_id)
    seen = {}
    hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        train.token_losses(model, block)
    finally:
        hook.remove()
    for name, key in [("position_ids", "position_ids"), ("seq_idx", "seq_idx")]:
        assert torch.equal(seen[name], block[key]), name
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(seen[name], block["cu_seqlens"]) and seen[name].dtype == torch.int32, name
    assert seen["max_length_q"] == seen["max_length_k"] == block["max_length"] and seen["use_cache"] is False


def test_block_without_loss_tokens_gives_zero_loss_and_gradient(model, tokenizer):
    filler = train.filler_block(tokenizer.pad_token_id)
    model.zero_grad()
    losses = train.token_losses(model, filler)
    assert losses.numel() == 0 and losses.sum().item() == 0.0
    losses.sum().backward()  # the graph stays connected, so FSDP's backward hooks would run: every weight gets a 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "model_type, setting",
    [
        ("granite", {"logits_scaling": 8.0}),
        ("gemma2", {}),
        ("cohere", {}),
        ("falcon_h1", {"lm_head_multiplier": 0.5}),
        ("inkling_text", {}),
    ],
)
def test_a_model_whose_logits_are_not_its_heads_matmul_is_refused(model_type, setting, world_of_one):
    """Granite divides its logits by logits_scaling, Gemma 2 caps them (final_logit_softcapping 30), Cohere scales them
    (logit_scale 0.0625), Falcon-H1 multiplies them, Inkling divides the head's input (logits_mup_width_multiplier 24):
    HeadLoss's cross-entropy of the plain head's would train another loss than the model's own (checked here: it
    differs), so build_model stops. A multiplier of 1 (Granite's default) trains."""
    from transformers import AutoConfig

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = AutoConfig.for_model(model_type, **tiny, num_key_value_heads=1, vocab_size=64, **setting)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # logits of a trained model's size, where a cap of 30 bites
        model.get_output_embeddings().weight.mul_(100)
    ids = torch.randint(0, 64, (1, 12))
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    plain = F.cross_entropy(hidden @ model.get_output_embeddings().weight.T, ids[0, 1:])
    assert not torch.isclose(plain, model(input_ids=ids, labels=ids).loss, rtol=1e-3)
    cfg = train.Config(model_name="unused", compile=False)
    with pytest.raises(train.UserError, match=f"the model's LM head has {{'{next(iter(setting), '')}"):
        train.build_model(config, cfg, "eager", world_of_one.device)
    if model_type == "granite":
        config.logits_scaling = 1.0
        train.build_model(config, cfg, "eager", world_of_one.device)


def test_hybrid_model_without_kernels_fails_at_start_with_an_install_hint(tmp_path):
    from make_tiny_model import write_tiny_model

    path = write_tiny_model(tmp_path / "hybrid", hybrid=True)
    with pytest.raises(train.UserError, match="needs flash-linear-attention and causal-conv1d: pip install"):
        train.require_kernels(train.model_config(path))


def test_attention_auto_is_sdpa_on_cpu_and_unavailable_backends_fail():
    assert train.resolve_attention("auto", torch.device("cpu")) == "sdpa"
    with pytest.raises(train.UserError, match="torch_varlen needs CUDA"):
        train.resolve_attention("torch_varlen", torch.device("cpu"))
    with pytest.raises(train.UserError, match="needs flash-attn"):
        train.resolve_attention("flash_attention_2", torch.device("cpu"))


@pytest.mark.parametrize("moments_fit, cuda_build", [(True, "13.0"), (False, "13.0"), (True, None)])
def test_auto_recompute_measures_each_layers_parts_in_forward_and_in_the_recomputation(
    tiny_model_dir, monkeypatch, world_of_one, capsys, moments_fit, cuda_build
):
    """The probe measures each layer's parts (its token mixer and MLP: its children with weights, norms aside) from
    their own __call__ (one class per kind of part, as torch.compile's guards want), and the measured step runs each
    layer's recomputation to its end (PyTorch stops it early by default): every part is measured twice, its output
    not counted but its input counted (a kept part keeps it); after the step the measuring is off and the original
    checkpoint function is back, and the next step runs as any other. Before the room is read, CUDA's stack limit
    is set back to its default (a CUDA build only), giving back what step 1's autotuning reserved. AdamW's
    moments stay on the GPU if step 1's peak before its optimizer step (whose own peak holds them) leaves room for
    them beside 2% of the GPU, by a byte either way; a step without blocks does not count, a non-finite one does.
    (CUDA's memory counters and driver are faked here: each forward "allocates" 1 MB more than it returns; the real
    memory is measured on the GPU, docs/BENCHMARKS.md.)"""
    records, allocated = [], itertools.cycle([0, 2**20])

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            records.append(self)

        def elapsed_time(self, end):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    limits, load = [], ctypes.CDLL  # CUDA's driver, its stack limit (0) set by cuCtxSetLimit, then room measured
    driver = type("Driver", (), {"cuCtxSetLimit": lambda self, limit, size: limits.append((limit, size.value))})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver() if name == "libcuda.so.1" else load(name))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    layers = model.get_decoder().layers
    original = [layer._gradient_checkpointing_func for layer in layers]

    class Job:
        pass

    job = Job()
    job.model, job.optimizer, job.d = model, torch.optim.AdamW(model.parameters()), world_of_one
    early_stop = torch.utils.checkpoint._enable_checkpoint_early_stop
    probe = train.RecomputeProbe(job)
    ids = torch.arange(3, 40)[None]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    moments, total = 2 * sum(p.nbytes for p in model.parameters()), 2**40
    peak = 0.98 * total - moments + (-1 if moments_fit else 1)  # by 98% of the GPU: step 1's peak bounds the next
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak)
    job.host_moments.to_device()  # as train_step calls it: the forward's and backward's peak, read
    job.optimizer.step()  # step 1's, which makes AdamW's moments: its peak holds them, and is not the one that counts
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak + moments)

    def mem_get_info():  # auto reads its room here: recorded, to see the stack limit set back before it
        limits.append("room")
        return total // 2, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: total // 2)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)
    n = len(probe.parts)
    assert [(i, name) for i, name, _ in probe.parts] == [(i, name) for i in range(len(layers)) for name in PARTS]
    assert len(records) == 2 * 2 * n  # a start and an end, in forward and in the recomputation
    assert all(records.index(start) >= 2 * n for start, _ in probe.events)  # the recomputation's are kept
    assert probe.bytes == [2**20] * n  # less the output, plus the input: both [1, 37, hidden] in fp32
    assert len({type(part) for _, _, part in probe.parts}) == len(PARTS)  # one class per kind of part
    monkeypatch.setattr(torch.version, "cuda", cuda_build)  # None: a ROCm build's (no libcuda), or a CPU build's
    probe.after_step(job, train.StepStats(max_blocks=0, blocks=0, loss_tokens=0, tokens=0, sum_sq_len=0))
    assert probe.seconds is None and probe.kept is None and not limits  # a step without blocks does not count
    skipped = train.StepStats(max_blocks=1, blocks=1, loss_tokens=36, tokens=37, sum_sq_len=37**2)  # loss_sum None:
    probe.after_step(job, skipped)  # non-finite, AdamW's step skipped (its moments made all the same): it counts
    assert probe.kept is None  # measured; the decision waits for the next step's peak
    reset = [(0, 1024)] if cuda_build else []  # the local memory step 1's autotuning reserved, given back
    assert limits == reset + ["room"]  # before room is read
    assert [layer._gradient_checkpointing_func for layer in layers] == original
    assert not any(part.measure for _, _, part in probe.parts)
    assert probe.seconds == [1e-3] * n
    assert torch.utils.checkpoint._enable_checkpoint_early_stop == early_stop  # turned off only inside each layer
    assert (job.host_moments is None) == moments_fit
    moved = f"0.0 GiB short of room for AdamW's moments ({moments / 2**30:.1f} GiB): they leave the GPU for each"
    assert (moved in capsys.readouterr().out) != moments_fit


def recomputed(probe) -> list:
    """Per layer: "whole" (transformers' checkpoint, no part's own), or its parts recomputed alone ([]: all kept)."""
    parts = [[name for k, name, part in probe.parts if k == i and part.recomputed] for i in range(len(probe.layers))]
    layers = zip(probe.layers, parts)
    return ["whole" if layer.gradient_checkpointing and not alone else alone for layer, alone in layers]


def test_auto_recompute_recomputes_a_kept_part_again_after_each_step_with_allocator_retries(
    tiny_model_dir, monkeypatch, world_of_one
):
    """After auto's decision, a step in which CUDA's allocator retried (on any rank) sends the part kept last back to
    recomputation (alone while its layer's other part is kept; with it, the whole layer); ten clean steps in a row
    end the watch. (The retry counter is faked; a world of one gloo process stands in for the ranks.)"""
    counter = iter([0, 2, 2, 3] + [3] * 10)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": next(counter)})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    job = type("Job", (), {"model": model, "progress": type("Progress", (), {"step": 2})()})()
    job.d, job.optimizer = world_of_one, torch.optim.AdamW(model.parameters())
    probe = train.RecomputeProbe(job)
    probe.kept = [3, 2]  # layer 1's MLP, then its attention
    states = []
    for _ in range(20):
        done = probe.watch()
        states.append(recomputed(probe))
        if done:
            break
    assert states[:4] == [["whole", []], ["whole", ["self_attn"]], ["whole", ["self_attn"]], ["whole", "whole"]]
    assert probe.kept == [] and done and len(states) == 14  # then 10 clean steps (nothing left to give back)


@pytest.mark.parametrize("sharding", [None, "resharded", "gathered"])
def test_a_part_recomputed_alone_gives_the_same_losses_and_gradients(tiny_model_dir, world_of_one, sharding):
    """auto's middle way: a layer's token mixer recomputed in backward and its MLP kept, or the other way round, also
    inside FSDP2's layers (a world of one gloo rank), whose parameters are gathered again for the backward or kept
    gathered from the forward. The losses and gradients equal those with nothing recomputed, bit for bit, and the
    part's forward runs again."""
    ids = torch.arange(3, 40)[None]

    def step(alone: str | None):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        calls = dict.fromkeys(PARTS, 0)
        for layer in model.get_decoder().layers:
            for name, part in train.recomputable_parts(layer):
                part.__class__ = type(type(part).__name__, (train.RecomputedPart, type(part)), {})
                part.recomputed = name == alone
                part.register_forward_pre_hook(lambda *_, name=name: calls.update({name: calls[name] + 1}))
            if sharding:
                fully_shard(layer, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=sharding == "resharded")
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        return loss, grads, calls

    reference_loss, reference_grads, _ = step(None)
    n = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers
    for alone in PARTS:
        loss, grads, calls = step(alone)
        assert loss.equal(reference_loss) and all(g.equal(r) for g, r in zip(grads, reference_grads, strict=True))
        assert calls == {name: 2 * n if name == alone else n for name in PARTS}


def test_recomputed_mlps_in_tiles_give_the_same_losses_and_gradients(tiny_model_dir, world_of_one, monkeypatch):
    """bench/long_levers.py's MLP tiles (a lever for long blocks, measured before it goes into train.py) through
    build_model's FSDP2 and recomputation, in fp32: tiles of 8 tokens over a 37-token block (the last tile shorter)
    against the same layers untiled, and tiled again at another size. A kept layer is not tiled."""
    import long_levers  # bench/ (pytest's pythonpath)

    cfg = train.Config(model_name=str(tiny_model_dir), param_dtype="float32", compile=False)
    model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    layers = model.get_decoder().layers
    layers[1].gradient_checkpointing = False
    block = train.make_block([(list(range(5, 42)), [i % 3 > 0 for i in range(37)])], 37, 0)
    tiled, apply = [], long_levers.TiledMLP.apply
    monkeypatch.setattr(long_levers.TiledMLP, "apply", lambda *a: tiled.append(a[1]) or apply(*a))

    def losses_and_grads():
        model.zero_grad(set_to_none=True)
        losses = model.token_losses(block)
        losses.sum().backward()
        return losses.detach(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    untiled = losses_and_grads()
    long_levers.tile_mlps(layers, 37)
    assert losses_and_grads()[0].equal(untiled[0]) and tiled == []  # 37 tokens: not longer than the tile
    for tile_tokens in (8, 16):
        long_levers.tile_mlps(layers, tile_tokens)
        losses, grads = losses_and_grads()
        assert tiled[-2:] == [tile_tokens] * 2  # layer 0 in forward and in its recomputation; layer 1 is kept
        torch.testing.assert_close(losses, untiled[0], rtol=1e-6, atol=0)
        mlp = [n for n in grads if ".0.mlp." in n]
        assert len(mlp) == 3 and all(grads[n].abs().sum() > 0 for n in mlp)
        for name, grad in grads.items():
            assert float((grad - untiled[1][name]).abs().max()) <= 1e-5 * float(untiled[1][name].abs().max()), name
    assert len(tiled) == 4  # never tiled inside a tile


def test_recomputed_layers_inputs_on_the_host_give_the_same_losses_and_gradients(tiny_model_dir, world_of_one):
    """bench/long_levers.py's SavedOnHost through build_model's FSDP2 and recomputation: the input that a recomputed
    layer's checkpoint saves goes to that layer's host buffer, reused by the next step; a kept layer keeps its own.
    On CPU the copies are plain (the CUDA streams and events are the GPU's): two steps give exactly the losses and
    gradients of the same steps without it."""
    import long_levers

    cfg = train.Config(model_name=str(tiny_model_dir), param_dtype="float32", compile=False)
    model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    layers = model.get_decoder().layers
    layers[1].gradient_checkpointing = False
    blocks = [train.make_block([(list(range(k, k + 37)), [i % 3 > 0 for i in range(37)])], 37, 0) for k in (5, 50)]

    def step(block):
        model.zero_grad(set_to_none=True)
        losses = model.token_losses(block)
        losses.sum().backward()
        return losses.detach(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    plain = [step(block) for block in blocks]
    hidden_state = 37 * model.config.hidden_size * 4
    on_host = long_levers.SavedOnHost(layers, hidden_state)
    moved = [step(blocks[0])]
    buffers = dict(on_host.buffers)
    moved.append(step(blocks[1]))
    assert list(buffers) == [(0, 0)]  # layer 0's input alone: layer 1 is kept, the rest are smaller
    assert on_host.buffers[(0, 0)] is buffers[(0, 0)]  # the second step reused it
    for (losses, grads), (plain_losses, plain_grads) in zip(moved, plain):
        assert losses.equal(plain_losses) and grads.keys() == plain_grads.keys()
        assert all(grads[n].equal(plain_grads[n]) for n in grads)


def test_host_moments_restart_cudas_peak_once_they_are_freed_before_step_1s_forward(monkeypatch):
    """auto reads step 1's peak as its forward's and backward's: HostMoments' first move to the host (step 1's, before
    its forward) restarts CUDA's peak after the moments' memory is freed, so that neither the load nor a resume's
    loaded moments count; later moves leave the peak alone (the watch reads it across steps). (CUDA's stream, copies
    and counters are faked: on CPU the moments' freed storage is what counts.)"""
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    model = torch.nn.Linear(8, 8)
    optimizer, resets = torch.optim.AdamW(model.parameters()), []

    def step():
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def allocated():  # the moments' device memory, as CUDA's counter would see it
        return sum(m.untyped_storage().nbytes() for m in train.HostMoments(optimizer, torch.device("cpu")).moments())

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(allocated()))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocated)  # what to_device reads: now, not a peak
    for resumed in (False, True):  # a new run's step 1 has no moments yet; a resume's has the loaded ones
        if resumed:
            step()
        moments, resets[:] = train.HostMoments(optimizer, torch.device("cpu")), []
        moments.stream = stream  # as on a GPU
        for _ in range(3):
            moments.to_host()
            moments.to_device()
            step()
        assert resets == [0] and moments.peak == 0  # once, with the moments' memory free; to_device read it before
        assert allocated() == 2 * 72 * 4  # back on the device after each step (a Linear(8, 8)'s two moments)


def test_adamw_moments_away_from_the_device_train_exactly_as_kept_there(tiny_model_dir, world_of_one):
    """HostMoments, auto's choice when step 1 leaves no room for AdamW's moments: during each step's forward and
    backward their memory is freed and their values wait in host buffers, reused step after step; they are back
    for the optimizer step, or after a skipped one. Three steps, the second skipped for a non-finite gradient, give
    exactly the weights and moments of the same steps with the moments left in place. (On CPU the copies are plain;
    CUDA's are pinned.)"""
    cfg = train.Config(model_name=str(tiny_model_dir), param_dtype="float32", compile=False)
    blocks = [train.make_block([(list(range(k, k + 37)), [i % 3 > 0 for i in range(37)])], 37, 0) for k in (5, 9, 50)]

    def three_steps(away: bool):
        model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
        train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
        optimizer, scheduler = train.make_optimizer(model, cfg, total_steps=10)
        freed, buffers = [], []

        def after_backward(step, model, loss_sum, blocks):
            if job.host_moments:  # what the forward and backward ran beside: no moment in device memory
                moments = job.host_moments.moments()
                freed.append((len(moments), sum(m.untyped_storage().nbytes() for m in moments)))
                buffers.append(list(job.host_moments.buffers))
            if step == 2:
                with torch.no_grad():
                    next(model.parameters()).grad.to_local().view(-1)[0] = float("nan")

        job = train.Job(cfg, world_of_one, model, optimizer, scheduler, 10, train.Progress(), train.filler_block(0))
        job.step_hook = after_backward
        job.host_moments = train.HostMoments(optimizer, world_of_one.device) if away else None
        stats, present = [], []
        for block in blocks:
            stats.append(train.train_step(job, [block]))
            moments = train.HostMoments(optimizer, world_of_one.device).moments()
            present.append(all(m.untyped_storage().nbytes() == m.nbytes for m in moments))
        assert present == [True] * 3  # back on the device after each step, a skipped one too: a save may follow
        moments = [m.clone() for m in train.HostMoments(optimizer, world_of_one.device).moments()]
        weights = [p.full_tensor() for p in model.parameters()]
        return [s.loss_sum is None for s in stats], weights, moments, freed, buffers

    kept, away = three_steps(False), three_steps(True)
    n = 2 * len(away[1])  # two moments per trained parameter
    assert kept[0] == away[0] == [False, True, False]  # step 2 skipped in both
    assert away[3] == [(0, 0), (n, 0), (n, 0)]  # step 1 had none yet; steps 2 and 3 ran with none on the device
    assert len(away[4][1]) == n and all(a is b for a, b in zip(away[4][1], away[4][2]))  # the same buffers
    assert all(m.abs().sum() > 0 for m in away[2]) and len(away[2]) == n
    assert all(a.equal(b) for a, b in zip(kept[1] + kept[2], away[1] + away[2]))


@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_one_rank_reduce_makes_fsdps_copy_of_the_gradients_a_copy_onto_itself(
    tiny_model_dir, examples, world_of_one, monkeypatch, master_dtype
):
    """On one rank FSDP "reduces" a module's gradients by copying its input buffer (them, cast to reduce_dtype) into an
    output buffer it asks its reduce-scatter for; build_model's OneRankReduce answers with the input itself. Over two
    blocks (the second's gradients added to the first's), each reduce's copy is of a tensor onto itself, which
    copy_ skips (with FSDP's own fresh buffers, none is), and the gradients equal those of FSDP's own buffers: fp32
    weights' gradients are views of that buffer; bf16 weights' are cast from it."""
    cfg = train.Config(model_name=str(tiny_model_dir), compile=False, master_dtype=master_dtype)
    blocks = [train.make_block([example], len(example[0]), 0) for example in examples[:2]]
    copies, copy_ = [], torch.Tensor.copy_

    def recorded_copy(self, src, *args, **kwargs):
        copies.append(self is src)
        return copy_(self, src, *args, **kwargs)

    class FreshBuffers:  # as FSDP's default reduce-scatter allocates
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

    grads, onto_itself = {}, {}
    for buffers in ("OneRankReduce", "fresh"):
        torch.manual_seed(0)
        model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
        train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
        modules = [*model.get_decoder().layers, model]
        for module in modules if buffers == "fresh" else []:
            module.set_custom_reduce_scatter(FreshBuffers())
        copies.clear()
        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "copy_", recorded_copy)
            for block in blocks:
                weight = 1 / block["loss_tokens"]
                (model.token_losses(block, loss_weight=weight).sum() * weight).backward()
        grads[buffers] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        onto_itself[buffers] = sum(copies)
    assert onto_itself == {"OneRankReduce": 2 * len(modules), "fresh": 0}  # each module's reduce, at each block
    assert grads["fresh"].keys() == grads["OneRankReduce"].keys() and len(grads["fresh"]) > 10
    assert all(grads["fresh"][n].equal(grads["OneRankReduce"][n]) for n in grads["fresh"])
    assert all(g.abs().sum() > 0 and g.dtype == getattr(torch, master_dtype) for g in grads["fresh"].values())


def test_one_rank_reduce_returns_the_input_only_to_fsdps_request_for_its_output():
    """OneRankReduce reads its caller's frame: it returns the caller's reduce_scatter_input only while the caller has
    not bound a reduce_output yet and asks for a buffer of the input's shape and dtype; otherwise a new buffer."""
    comm, cpu = train.OneRankReduce(), torch.device("cpu")

    def foreach_reduce_like():  # foreach_reduce's names and order, and a third request after the output
        reduce_scatter_input = comm.allocate((6,), dtype=torch.float32, device=cpu)
        other_size = comm.allocate((3,), dtype=torch.float32, device=cpu)
        other_dtype = comm.allocate((6,), dtype=torch.bfloat16, device=cpu)
        reduce_output = comm.allocate((6,), dtype=torch.float32, device=cpu)
        after_output = comm.allocate((6,), dtype=torch.float32, device=cpu)
        return reduce_scatter_input, other_size, other_dtype, reduce_output, after_output

    given, other_size, other_dtype, output, after_output = foreach_reduce_like()
    assert output is given
    assert all(t is not given for t in (other_size, other_dtype, after_output))
    assert comm.allocate((6,), dtype=torch.float32, device=cpu) is not given  # a caller without FSDP's names


def test_a_frozen_vision_tower_is_a_unit_of_its_own_that_training_never_gathers(world_of_one, tmp_path, monkeypatch):
    """FSDP gathers a unit's parameters before the unit's forward. A VLM's vision tower, frozen and never called in text
    SFT, is a unit of its own (build_model): no unit holding it is gathered through forward and backward, while the
    root's unit gathers the embedding, the final norm and the LM head. In the root's unit, each step would gather it."""
    from make_tiny_model import write_tiny_model
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    source = write_tiny_model(tmp_path / "hybrid", hybrid=True)
    cfg = train.Config(model_name=str(source), compile=False)
    model = train.build_model(train.model_config(source), cfg, "sdpa", world_of_one.device)
    tower = {n for n, p in model.named_parameters() if n.startswith("model.visual.")}
    assert tower and {n for n, p in model.named_parameters() if not p.requires_grad} == tower
    gathered = []  # the names of the parameters not sharded (not DTensors) when the decoder's forward begins

    def record(module, args):
        gathered.append({n for n, p in model.named_parameters() if not isinstance(p, DTensor)})

    model.get_decoder().register_forward_pre_hook(record)
    owners, unshard = [], FSDPParamGroup.unshard  # for each unit gathered, the modules owning its parameters

    def recorded_unshard(group, *args, **kwargs):
        owners.append({fsdp_param._module_info.module for fsdp_param in group.fsdp_params})
        return unshard(group, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", recorded_unshard)
    ids = torch.arange(3, 40)[None]
    model(input_ids=ids, labels=ids).loss.backward()  # one sequence: no packed signals, no kernels needed
    root = {"model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight"}
    assert gathered == [root]
    assert len(owners) > 2 and not any(owned & set(model.model.visual.modules()) for owned in owners)
    assert all(isinstance(p, DTensor) and p.grad is None for n, p in model.named_parameters() if n in tower)


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])
def test_train_step_clips_the_gradients_as_clip_grad_norm_does(tiny_model_dir, examples, world_of_one, max_grad_norm):
    """train_step leaves the clipping to fused AdamW (its grad_scale divides each gradient as it is read): each of
    three steps, every one clipped (max_grad_norm 1e-3) or none (1e3), gives the weights that clip_grad_norm_ and an
    unfused AdamW give from the same weights and moments. Unclipped, the first case's steps are far from them: the
    check can fail. (Each step starts the references from train_step's state: over several steps, an ulp of
    difference in the weights changes a later gradient's noise-sized elements, which Adam's normalising turns into
    whole updates, on some CPUs and not others.)"""
    cfg = train.Config(model_name=str(tiny_model_dir), compile=False, max_grad_norm=max_grad_norm, learning_rate=1e-2)
    blocks = [train.make_block([example], len(example[0]), 0) for example in examples[:3]]
    built = []
    for _ in range(2):  # train_step's, then the references'
        torch.manual_seed(0)
        built.append(train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device))
        train.load_pretrained(built[-1], tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    model, reference = built
    (optimizer, scheduler), (reference_optimizer, _) = (train.make_optimizer(m, cfg, total_steps=3) for m in built)
    job = train.Job(cfg, world_of_one, model, optimizer, scheduler, 3, train.Progress(), {})
    for block in blocks:
        weights, weight = {}, 1 / block["loss_tokens"]  # as train_step's scale: HeadLoss computes its gradients for it
        for how in ("clip_grad_norm_", "unclipped"):  # torch's for-loop AdamW, after clip_grad_norm_ or nothing
            reference.load_state_dict(model.state_dict())
            reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # this step's lr too
            for group in reference_optimizer.param_groups:
                group["fused"] = False
            (reference.token_losses(block, loss_weight=weight).sum() * weight).backward()
            if how == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_grad_norm)
            reference_optimizer.step(), reference_optimizer.zero_grad()
            weights[how] = torch.cat([p.full_tensor().flatten() for p in reference.parameters()])
        assert train.train_step(job, [block]).loss_sum is not None
        weights["train_step"] = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
        moved = (weights["clip_grad_norm_"] - weights["train_step"]).abs().max()
        unclipped = (weights["clip_grad_norm_"] - weights["unclipped"]).abs().max()
        assert moved <= 1e-6, (job.progress.step, moved)
        assert unclipped > 100 * 1e-6 if max_grad_norm < 1 else unclipped <= 1e-6, (job.progress.step, unclipped)


def test_a_non_finite_gradient_norm_leaves_weights_moments_and_step_counts_as_they_were(tiny_model_dir, world_of_one):
    """train_step dispatches AdamW before it reads the norm: the skip happens on the device (found_inf). A NaN in one
    gradient at step 2 leaves every weight, moment and step count as step 1 left them, and step 3 steps as 2."""
    cfg = train.Config(model_name=str(tiny_model_dir), param_dtype="float32", compile=False)
    blocks = [train.make_block([(list(range(k, k + 37)), [i % 3 > 0 for i in range(37)])], 37, 0) for k in (5, 9, 50)]
    model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    optimizer, scheduler = train.make_optimizer(model, cfg, total_steps=10)

    def poison_step_2(step, model, loss_sum, blocks):
        if step == 2:
            with torch.no_grad():
                next(model.parameters()).grad.to_local().view(-1)[0] = float("nan")

    job = train.Job(cfg, world_of_one, model, optimizer, scheduler, 10, train.Progress(), train.filler_block(0))
    job.step_hook = poison_step_2

    def state():
        moments = [t.to_local().clone() for v in optimizer.state.values() for t in (v["exp_avg"], v["exp_avg_sq"])]
        return [p.to_local().clone() for p in model.parameters()] + moments, [
            float(v["step"]) for v in optimizer.state.values()
        ]

    stats = [train.train_step(job, [blocks[0]])]
    after_1 = state()
    stats.append(train.train_step(job, [blocks[1]]))
    after_2 = state()
    stats.append(train.train_step(job, [blocks[2]]))
    assert [s.loss_sum is None for s in stats] == [False, True, False] and job.progress.bad_steps == 1
    assert after_2[1] == after_1[1] == [1.0] * len(after_1[1]) and state()[1] == [2.0] * len(after_1[1])
    assert all(a.equal(b) for a, b in zip(after_1[0], after_2[0])) and len(after_1[0]) == 3 * len(after_1[1])
    assert not all(a.equal(b) for a, b in zip(after_2[0], state()[0]))  # step 3 moved them: the check can fail


def growing_probe(tiny_model_dir, monkeypatch, world_of_one, peaks: list, retries: list, kept: list):
    """A RecomputeProbe growing at step 3 of a 2-layer model (each layer FSDP2-sharded), from the parts
    kept: each part 100 bytes (1, 2, 3 and 4 s of recomputation: 1.mlp saves the most per byte), the layers' gathered
    parameters 1,000 bytes, a GPU of 10,000; CUDA's peak and retry count faked, the next of each list per step."""
    peaks, retries = iter(peaks), iter(retries)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": next(retries)})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10_000, 10_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert len(model.get_decoder().layers) == 2
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    job = type("Job", (), {"model": model, "progress": type("Progress", (), {"step": 3})()})()
    job.d, job.optimizer = world_of_one, torch.optim.AdamW(model.parameters())
    probe = train.RecomputeProbe(job)
    probe.kept, probe.sizes, probe.seconds, probe.growing = kept, [100.0] * 4 + [1e3], [1.0, 2.0, 3.0, 4.0, 0.0], True
    return probe


def test_auto_recompute_keeps_more_parts_while_the_measured_peak_leaves_room(
    tiny_model_dir, monkeypatch, world_of_one, capsys
):
    """From step 2 on, each step keeps the recomputed parts that room beside the peak measured so far allows (the
    measured peaks decide, not a sum of sizes), the most time saved per byte first, until a step retries an
    allocation, which gives the part kept last back and ends the growing."""
    probe = growing_probe(tiny_model_dir, monkeypatch, world_of_one, [8_750, 8_850, 0], [0, 1, 1], kept=[3])
    states = []
    for _ in range(3):
        probe.watch()
        states.append(recomputed(probe))
    # 10,000 - 10% unplanned - 8,750 leaves 250: two parts are kept, layer 1's attention and layer 0's MLP; the next
    # step retries, so layer 0's MLP is recomputed again (with its attention: the whole layer), and a step with all
    # the room in the world keeps nothing more
    assert states == [[["self_attn"], []], ["whole", []], ["whole", []]] and probe.kept == [3, 2]
    out = capsys.readouterr().out
    assert not probe.growing and "step 3: peak 0.0 GiB, room for ['1.self_attn', '0.mlp'] too" in out
    assert "step 3: 1 allocation retries, 0.mlp back; 2 of 5 kept" in out


def test_auto_recompute_keeps_the_gathered_parameters_in_room_that_no_part_fits(
    tiny_model_dir, monkeypatch, world_of_one, capsys
):
    """With every part kept, room left keeps each layer's gathered parameters from its forward to its backward
    (FSDP2's reshard_after_forward off), until an allocator retry gives them back."""
    probe = growing_probe(tiny_model_dir, monkeypatch, world_of_one, [7_000, 0], [0, 1], [0, 1, 2, 3])
    resharded = []
    for _ in range(2):
        probe.watch()
        resharded.append([layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info for layer in probe.layers])
    assert [[info is not None for info in step] for step in resharded] == [[False, False], [True, True]]
    assert "room for ['gathered parameters'] too" in capsys.readouterr().out


def test_auto_recompute_stops_keeping_parts_after_retries_even_with_none_kept(
    tiny_model_dir, monkeypatch, world_of_one
):
    """Allocator retries in a step that keeps nothing yet still end the growing: the next step, with all the room in
    the world, keeps no part."""
    probe = growing_probe(tiny_model_dir, monkeypatch, world_of_one, [0, 0], [1, 1], kept=[])
    probe.watch(), probe.watch()
    assert probe.kept == [] and not probe.growing and recomputed(probe) == ["whole", "whole"]


def test_train_step_clips_bf16_master_weights_too(tiny_model_dir, examples, world_of_one):
    """With master_dtype bfloat16 (the seed's all-bf16 mode) the gradient norm is bf16; fused AdamW takes its clip
    factor in fp32 only: a step that clips runs and moves the weights."""
    cfg = train.Config(model_name=str(tiny_model_dir), compile=False, master_dtype="bfloat16", max_grad_norm=1e-3)
    model = train.build_model(train.model_config(tiny_model_dir), cfg, "sdpa", world_of_one.device)
    train.load_pretrained(model, tiny_model_dir, train.checkpoint_dtypes(tiny_model_dir))
    optimizer, scheduler = train.make_optimizer(model, cfg, total_steps=1)
    before = [p.full_tensor().clone() for p in model.parameters()]
    job = train.Job(cfg, world_of_one, model, optimizer, scheduler, 1, train.Progress(), {})
    stats = train.train_step(job, [train.make_block([examples[0]], len(examples[0][0]), 0)])
    assert stats.loss_sum is not None and stats.grad_norm > cfg.max_grad_norm
    assert any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "device_name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),  # a PCIe or NVL card's name holds its SXM sibling's: its own key comes first
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA L40S", None),  # no peak known: no MFU rather than a wrong one
    ],
)
def test_mfu_divides_by_the_peak_of_the_card_itself(device_name, peak, model, monkeypatch):
    for name in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: device_name)
    on_a_gpu = train.Dist(0, 1, torch.device("cuda"), False, None, None)
    assert train.MetricsLog(train.Config(), on_a_gpu, model).peak == peak


@pytest.mark.parametrize("warmup_steps, total_steps, warned", [(10, 4, True), (4, 4, True), (3, 4, False)])
def test_a_warmup_as_long_as_the_run_is_said_at_the_start(model, warmup_steps, total_steps, warned):
    """lr_factor's warmup then never ends: the lr stays below learning_rate for the whole run."""
    cfg, d = train.Config(warmup_steps=warmup_steps), train.Dist(0, 1, torch.device("cpu"), False, None, None)
    described = train.describe_model(model, cfg, d, "sdpa", total_steps, seconds=1.0, measured=False)
    assert described.startswith("model: ") and f"| steps {total_steps} |" in described
    assert ("warning: warmup_steps >= steps: lr stays below learning_rate" in described) == warned


def test_a_window_with_a_skipped_step_counts_its_tokens_everywhere_but_in_the_loss(model, world_of_one, tmp_path):
    """A step skipped for a non-finite loss trained its blocks' tokens (they count in the speed and the fractions)
    but has no loss: the window's loss is the stepped steps' token mean."""
    cfg = train.Config(output_dir=str(tmp_path), log_every=2, max_seq_len=100)
    log, progress = train.MetricsLog(cfg, world_of_one, model), train.Progress()
    job = types.SimpleNamespace(progress=progress, total_steps=4)
    for loss_sum, loss_tokens in [(60.0, 30), (None, 50)]:  # the second step skipped
        progress.step += 1
        log.after_step(job, train.StepStats(1, 1, loss_tokens, 90, 0, loss_sum=loss_sum, grad_norm=1.0, lr=1e-5))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["loss"] == 2.0  # 60 / 30
    assert record["loss_token_fraction"] == 80 / 200 and record["non_padding_fraction"] == 180 / 200
    assert record["loss_tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s_per_gpu"] * 80 / 180)
