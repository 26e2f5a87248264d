"""Levers for long blocks (issue 26), measured by the bench before any of them goes into train.py.

MLP tiles: a recomputed layer's MLP over a block longer than the tile runs a tile of tokens at a time (the tiled MLP
of Arctic Long Sequence Training). Its recomputation then holds one tile's MLP activations instead of the block's,
at the price of one more MLP forward per recomputed layer (TiledMLP saves only the MLP's input; its backward runs
each tile's forward again, then that tile's backward). Kept layers and blocks up to the tile run as before.

Saved tensors on the host: what a step's forward saves outside the recomputed layers (their inputs, the final
norm's, the fused head's gradients) and is at least min_bytes goes to pinned host buffers, copied out on a side
stream that overlaps the forward and back on the compute stream when backward needs it (the copies back are not
prefetched). The buffers are allocated once and reused every step, in the order the forward saves.

    bench.py ours ... --mlp-tiles 32768     the recipe's run with its recomputed layers' MLPs in tiles
    bench.py layers ... --mlp-tiles 32768   the per-layer memory and time, tiled against untiled
    bench.py ours ... --saved-on-host-mib 256   the recipe's run with its large saved tensors on the host

docs/LONG_BLOCKS.md has what was measured; tests/test_model.py checks that each lever gives the losses and gradients
without it through train.build_model (FSDP2, recomputation).
"""

from __future__ import annotations

import torch


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


def with_mlp_tiles(tile_tokens: int) -> None:
    """From now on, train.build_model's models have their recomputed layers' MLPs in tiles (bench.py ours)."""
    import train

    build_model = train.build_model

    def build_tiled(*args, **kwargs):
        model = build_model(*args, **kwargs)
        tile_mlps(model.get_decoder().layers, tile_tokens)
        return model

    train.build_model = build_tiled


class SavedOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of at least min_bytes in host buffers (pinned for a GPU's), the i-th saved of a forward in the
    i-th buffer. A forward starts at buffer 0 when it enters; a step's backward ends before the next forward."""

    def __init__(self, min_bytes: int):
        self.min_bytes, self.buffers, self.used, self.stream = min_bytes, [], 0, None
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        self.used = 0
        return super().__enter__()

    def pack(self, tensor):
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        cuda = tensor.device.type == "cuda"
        if self.used == len(self.buffers) or self.buffers[self.used].shape != tensor.shape:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
            self.buffers[self.used : self.used + 1] = [host]
        host, self.used = self.buffers[self.used], self.used + 1
        if not cuda:
            return host.copy_(tensor), tensor.device
        self.stream = self.stream or torch.cuda.Stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written; an earlier
        with torch.cuda.stream(self.stream):  # copy back out of this buffer has been read
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is free once the copy has ended
        return host, tensor.device

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(self.stream)
        return host.to(device, non_blocking=True)


def with_saved_on_host(min_bytes: int) -> None:
    """From now on, train.build_model's models run token_losses (the decoder, the head and the loss) with their
    large saved tensors on the host (bench.py ours)."""
    import train

    token_losses, hooks = train.token_losses, SavedOnHost(min_bytes)

    def token_losses_saved_on_host(*args, **kwargs):
        with hooks:
            return token_losses(*args, **kwargs)

    train.token_losses = token_losses_saved_on_host
