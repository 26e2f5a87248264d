"""Run by tests/test_distributed.py under torchrun: one accumulation step of the recipe's FSDP2 path over
blocks that the test assigns per rank; rank 0 saves the all-reduced loss and the full gradients."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import train

model_dir, blocks_file, out_file, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
d = train.setup_distributed()
cfg = train.Config(model_name=model_dir, model_revision="", param_dtype="float32", **overrides)
config = train.model_config(Path(model_dir))
model = train.build_model(config, cfg, "sdpa", d.device)
train.load_pretrained(model, Path(model_dir), train.checkpoint_dtypes(Path(model_dir)))
per_rank = json.loads(Path(blocks_file).read_text())
blocks = [train.make_block(segments, length, pad_id=0) for segments, length in per_rank[d.rank]]
counts = train.global_counts(blocks, d)
n_micro, loss_tokens = counts.max_blocks, counts.loss_tokens
filler = train.filler_block(0)
loss_sum = train.run_blocks(model, blocks, n_micro, filler, cfg, d, scale=d.world_size / loss_tokens)
dist.all_reduce(loss_sum)
grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
if d.rank == 0:
    checkpointed = [layer.gradient_checkpointing for layer in model.get_decoder().layers]
    result = {"loss": loss_sum.item() / loss_tokens, "grads": grads, "n_micro": n_micro, "checkpointed": checkpointed}
    torch.save(result, out_file)
# Both ranks tear gloo down together (rank 0 may still be saving): suspected cause of a rare abort at exit
# without this barrier, 'terminate called without an active exception' (CI, 2026-11-30).
dist.barrier()
dist.destroy_process_group()
