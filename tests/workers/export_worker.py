"""Run by tests/test_checkpoint.py under torchrun. Builds the recipe's sharded model and loads it from a
Hugging Face checkpoint (or, given a third argument, from a DCP training checkpoint), then rank 0 saves its
full parameters, buffers and the logits of a fixed input; finally the recipe's export writes OUT/model.

    torchrun --nproc_per_node=2 tests/workers/export_worker.py MODEL_DIR OUT_DIR [CHECKPOINT_DIR]
"""

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from clean_exit import leave
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import train

source, out = Path(sys.argv[1]), Path(sys.argv[2])
d = train.setup_distributed()
out.mkdir(parents=True, exist_ok=True)
cfg = train.Config(model_name=str(source), model_revision="", param_dtype="float32", output_dir=str(out), compile=False)
config, dtypes = train.model_config(source), train.checkpoint_dtypes(source)
model = train.build_model(config, cfg, "sdpa", d.device)
if len(sys.argv) > 3:
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=sys.argv[3])
    set_model_state_dict(model, state["model"])
else:
    train.load_pretrained(model, source, dtypes)
params = {name: p.full_tensor() for name, p in model.named_parameters()}
buffers = {name: b.clone() for name, b in model.named_buffers()}
input_ids = torch.arange(3, 40)[None]
with torch.no_grad():
    logits = model(input_ids=input_ids, position_ids=torch.arange(37)[None]).logits
if d.rank == 0:
    torch.save({"params": params, "buffers": buffers, "input_ids": input_ids, "logits": logits}, out / "fsdp.pt")
train.export_hf(model, train.load_tokenizer(cfg), source, dtypes, cfg, d)
leave()  # clean_exit.py: as train.py's main() leaves
