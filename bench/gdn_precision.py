#!/usr/bin/env python3
"""What bf16 A_log and dt_bias do to a Gated DeltaNet layer over a 32k sequence (docs/BENCHMARKS.md).

The checkpoint and the fp32 masters keep A_log and dt_bias in fp32, but FSDP all-gathers them with the rest of
the layer in param_dtype (bf16) for compute. One Qwen3.8-27B-geometry Gated DeltaNet layer (random weights,
the model's own A_log and dt_bias initialisation) runs one 32k sequence three ways: everything fp32 (the
reference), bf16 with A_log and dt_bias kept fp32, and all bf16 (what the recipe computes). Printed: each
variant's relative error against the reference, over the whole sequence and over its first and last 4k tokens
(an error the decay carries along would grow with the position), and the relative error of the decay g itself.

    python3 bench/gdn_precision.py bench/configs/qwen3.8-27b-geometry-8layers [--tokens 32768]
"""

import argparse
import copy

import torch
from transformers import AutoConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_config")
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.model_config).get_text_config()
    torch.manual_seed(0)
    reference = Qwen3_5GatedDeltaNet(config, layer_idx=0).cuda().float()
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0, config.initializer_range)
    mixed = copy.deepcopy(reference).bfloat16()
    mixed.A_log, mixed.dt_bias = copy.deepcopy(reference.A_log), copy.deepcopy(reference.dt_bias)
    all_bf16 = copy.deepcopy(reference).bfloat16()
    x = torch.randn(1, args.tokens, config.hidden_size, device="cuda")
    a = reference.in_proj_a(x).float()
    g = {
        name: -layer.A_log.float().exp() * torch.nn.functional.softplus(a + layer.dt_bias)
        for name, layer in (("fp32", reference), ("bf16", all_bf16))
    }
    with torch.no_grad():
        out = {"fp32": reference(x)}
        out["bf16, A_log and dt_bias fp32"] = mixed(x.bfloat16())
        out["all bf16 (the recipe)"] = all_bf16(x.bfloat16())
    k = 4096
    print(f"{args.tokens} tokens; relative error against fp32: whole | first {k} | last {k}")
    for name, y in list(out.items())[1:]:
        whole, first, last = rel(y, out["fp32"]), rel(y[:, :k], out["fp32"][:, :k]), rel(y[:, -k:], out["fp32"][:, -k:])
        print(f"{name:32s} {whole:.5f} | {first:.5f} | {last:.5f}")
    print(f"decay g with bf16 A_log and dt_bias: relative error {rel(g['bf16'], g['fp32']):.5f}")


if __name__ == "__main__":
    main()
