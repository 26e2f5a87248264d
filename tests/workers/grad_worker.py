"""Run by tests/test_distributed.py under torchrun: one optimizer step of the recipe's own train_step over blocks
that the test assigns per rank (its normaliser, fillers and FSDP2 reduction); rank 0 saves the loss over all ranks
and the full gradients, taken by the step hook after the backward, before clipping."""

import json
import sys
from pathlib import Path

import torch
from clean_exit import leave

import train

model_dir, blocks_file, out_file, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
d = train.setup_distributed()
cfg = train.Config(model_name=model_dir, model_revision="", param_dtype="float32", **overrides)
config = train.model_config(Path(model_dir))
model = train.build_model(config, cfg, "sdpa", d.device)
train.load_pretrained(model, Path(model_dir), train.checkpoint_dtypes(Path(model_dir)))
optimizer, scheduler = train.make_optimizer(model, cfg, total_steps=1)
per_rank = json.loads(Path(blocks_file).read_text())
blocks = [train.make_block(segments, length, pad_id=0) for segments, length in per_rank[d.rank]]
grads = {}


def take_gradients(step, model, loss_sum, blocks):
    grads.update({name: p.grad.full_tensor() for name, p in model.named_parameters()})  # a collective: every rank


job = train.Job(cfg, d, model, optimizer, scheduler, 1, train.Progress(), train.filler_block(0), take_gradients)
stats = train.train_step(job, blocks)
loss_sum = train.all_reduced(stats.loss_sum, d, dtype=torch.float64).item()  # this rank's, as the host has it
if d.rank == 0:
    checkpointed = [layer.gradient_checkpointing for layer in model.get_decoder().layers]
    result = {"loss": loss_sum / stats.loss_tokens, "grads": grads, "n_micro": stats.max_blocks}
    torch.save({**result, "checkpointed": checkpointed, "stepped": job.progress.step}, out_file)
leave()  # clean_exit.py: as train.py's main() leaves
