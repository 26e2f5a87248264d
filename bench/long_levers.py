"""Levers for long blocks (issue 26), measured by the bench before any of them goes into train.py.

MLP tiles: a recomputed layer's MLP over a block longer than the tile runs a tile of tokens at a time (the tiled MLP
of Arctic Long Sequence Training). Its recomputation then holds one tile's MLP activations instead of the block's,
at the price of one more MLP forward per recomputed layer (TiledMLP saves only the MLP's input; its backward runs
each tile's forward again, then that tile's backward). Kept layers and blocks up to the tile run as before.

    bench.py ours ... --mlp-tiles 32768     the recipe's run with its recomputed layers' MLPs in tiles
    bench.py layers ... --mlp-tiles 32768   the per-layer memory and time, tiled against untiled

docs/LONG_BLOCKS.md has what was measured; tests/test_model.py checks that the tiles give the untiled losses and
gradients through train.build_model (FSDP2, recomputation).
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
