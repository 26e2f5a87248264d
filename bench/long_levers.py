"""Levers for long blocks (issue 26), measured by the bench before any of them goes into train.py.

MLP tiles: a recomputed layer's MLP over a block longer than the tile runs a tile of tokens at a time (the tiled MLP
of Arctic Long Sequence Training). Its recomputation then holds one tile's MLP activations instead of the block's,
at the price of one more MLP forward per recomputed layer (TiledMLP saves only the MLP's input; its backward runs
each tile's forward again, then that tile's backward). Kept layers and blocks up to the tile run as before.

Saved inputs on the host: what each recomputed layer's checkpoint saves for its recomputation (the layer's input;
tensors of at least min_bytes) goes to pinned host buffers, copied out on a side stream that overlaps the forward,
and back on the compute stream when backward recomputes the layer (not prefetched). Each layer's buffers are its
own, allocated once and reused every step.

    bench.py ours ... --mlp-tiles 32768     the recipe's run with its recomputed layers' MLPs in tiles
    bench.py layers ... --mlp-tiles 32768   the per-layer memory and time, tiled against untiled
    bench.py ours ... --saved-on-host-mib 256   the recipe's run with its recomputed layers' inputs on the host

docs/LONG_BLOCKS.md has what was measured; tests/test_model.py checks that each lever gives the losses and gradients
without it through train.build_model (FSDP2, recomputation).
"""

from __future__ import annotations

from functools import partial

import torch

import train


class TiledMLP(torch.autograd.Function):
    """forward: the MLP tile by tile, saving its input only. backward: each tile's forward again, then its backward,
    accumulating the parameters' gradients into their .grad (FSDP2's unsharded parameters, reduced after the layer)."""

    @staticmethod
    def forward(ctx, call, tile_tokens: int, x, *params):
        ctx.call, ctx.tile_tokens, ctx.params = call, tile_tokens, params
        ctx.save_for_backward(x)
        return torch.cat([call(tile) for tile in x.split(tile_tokens, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,), grads, n = ctx.saved_tensors, [], ctx.tile_tokens
        for tile, tile_grad in zip(x.split(n, dim=1), grad.split(n, dim=1)):
            tile = tile.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(ctx.call(tile), tile_grad, inputs=[tile, *ctx.params])
            grads.append(tile.grad)
        return None, None, torch.cat(grads, dim=1), *[None] * len(ctx.params)


def tile_mlps(layers, tile_tokens: int) -> None:
    """Each dense MLP of these decoder layers runs in tiles of tile_tokens when its layer is recomputed and the block
    is longer. A compiled MLP (Module.compile, train.compile_elementwise) keeps a compiled forward."""
    for layer in (layer for layer in layers if type(getattr(layer, "mlp", None)).__name__.endswith("MLP")):
        mlp = layer.mlp
        call = getattr(mlp, "untiled_forward", mlp.forward)  # tiled again (another tile size): from the untiled one
        if getattr(mlp, "_compiled_call_impl", None) is not None:  # Module.compile compiles __call__, not forward
            call, mlp._compiled_call_impl = torch.compile(call, dynamic=False), None
        mlp.untiled_forward = call

        def forward(x, layer=layer, call=call):
            if x.shape[1] <= tile_tokens or not (layer.gradient_checkpointing and torch.is_grad_enabled()):
                return call(x)
            return TiledMLP.apply(call, tile_tokens, x, *layer.mlp.parameters())

        mlp.forward = forward


class SavedOnHost:
    """The inputs that each recomputed layer's checkpoint saves (at least min_bytes each) in host buffers, pinned for
    a GPU's: the layer's buffers are its own, reused every step, reallocated if a shape or dtype changes. The copy
    out runs on a side stream and ends with an event the copy back waits for; backward's copies back are not
    prefetched. Kept layers, the final norm and the head keep theirs on the GPU: they are needed first in backward."""

    def __init__(self, layers, min_bytes: int):
        self.min_bytes, self.buffers, self.stream = min_bytes, {}, None
        for i, layer in enumerate(layers):
            checkpoint = layer._gradient_checkpointing_func  # transformers' (RecomputeProbe's wraps this one)

            def offloaded(*args, i=i, checkpoint=checkpoint, **kwargs):
                seen = {}  # a tensor saved twice in one call is copied once
                hooks = (partial(self.pack, i, seen), self.unpack)
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    return checkpoint(*args, **kwargs)

            layer._gradient_checkpointing_func = offloaded

    def pack(self, layer: int, seen: dict, tensor):
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        key = (tensor.data_ptr(), tensor._version, tensor.shape, tensor.dtype)
        if key in seen:
            return seen[key]
        slot, cuda = (layer, len(seen)), tensor.device.type == "cuda"
        host = self.buffers.get(slot)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = self.buffers[slot] = train.host_buffer(tensor)  # pinned in place (on a GPU), not rounded up
        done = None
        if cuda:
            self.stream = self.stream or torch.cuda.Stream(tensor.device)
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # written; last step's copy back read
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            tensor.record_stream(self.stream)  # its memory is free once the copy has ended
        else:
            host.copy_(tensor)
        seen[key] = packed = (host, tensor.device, done)
        return packed

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, device, done = packed
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
            return host.to(device, non_blocking=True)
        return host.clone()  # a tensor of its own, as the GPU's copy back is (backward may change it in place)


def on_each_built_model(lever) -> None:
    """From now on, lever(decoder layers) runs on each model that train.build_model builds (bench.py ours)."""
    import train

    build_model = train.build_model

    def build_with_lever(*args, **kwargs):
        model = build_model(*args, **kwargs)
        lever(model.get_decoder().layers)
        return model

    train.build_model = build_with_lever
