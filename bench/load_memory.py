#!/usr/bin/env python3
"""Peak host memory per rank while loading a checkpoint: the seed's method against the recipe's.

  seed:    every rank runs from_pretrained (bf16, as the seed loads it), then fully_shard keeps its shard
  seed-fp32: the same with fp32 master weights, what the seed's method costs once it keeps fp32 masters
  sharded: the recipe (train.build_model + train.load_pretrained): meta-device model, fully_shard, each rank
           reads only its own slices from the safetensors files, into fp32 master weights

On CPU the shards themselves live in host memory, so `sharded` includes this rank's fp32 shard
(4 bytes x parameters / ranks); on GPUs it goes to the device and the host keeps only read buffers.

    python bench/load_memory.py make /tmp/ckpt                                  # ~1B parameters, 2 GB bf16
    torchrun --nproc_per_node=2 bench/load_memory.py seed /tmp/ckpt
    torchrun --nproc_per_node=2 bench/load_memory.py sharded /tmp/ckpt
"""

import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB")
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {path}")


def load(method: str, path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    d = train.setup_distributed()
    before, t0 = rss_gib(), time.perf_counter()
    if method.startswith("seed"):
        dtype = torch.float32 if method == "seed-fp32" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        mesh = init_device_mesh("cpu", (d.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        cfg = train.Config(model_name=str(path), model_revision="")
        model = train.build_model(train.model_config(path), cfg, "sdpa", d.device)
        train.load_pretrained(model, path, train.checkpoint_dtypes(path))
    seconds = time.perf_counter() - t0
    peaks = [None] * d.world_size
    dist.all_gather_object(peaks, (rss_gib(), before))
    if d.rank == 0:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
        print(
            f"LOAD {method:9s} ranks {d.world_size} | checkpoint {size:.2f} GiB | peak host RSS per rank "
            + ", ".join(f"{peak:.2f}" for peak, _ in peaks)
            + f" GiB (after imports {peaks[0][1]:.2f}) | "
            f"{seconds:.1f}s"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    make(sys.argv[2]) if sys.argv[1] == "make" else load(sys.argv[1], Path(sys.argv[2]))
