#!/usr/bin/env bash
# Faults mid-run on GPUs (README, "Faults mid-run"), what tests/test_checkpoint.py checks on CPU with gloo, here with
# NCCL and the recipe's GPU settings (compiled norms and MLPs, bf16, torch_varlen, fla and causal-conv1d) on
# tests/test_gpu.py's small qwen3_5 hybrid with the tiny tokenizer and the bundled sample:
#   1. straight: STEPS steps with synchronous saves every 5 (written over the saves' gloo group) and the export;
#   2. restarted: the same under torchrun --max-restarts=1, rank 0 SIGKILLed in step 7 of the first attempt: the
#      workers restart inside the job (NCCL joins again through the attempt's own keys) and resume from step 5.
# Prints what each run said about the restart, its last step, and the restarted run's differences from the straight
# one (GPU runs are not bit-identical: fla's autotuned kernels).
#
#   bash bench/gpu_restart.sh RESULTS_DIR [NGPU] [STEPS]
#
# Needs the GPU machine's packages (source bench/device_env.sh) and, on Hopper with Triton < 3.7.1, tilelang.
set -uo pipefail
R=$(realpath -m "${1:?results dir}") NGPU=${2:-1} STEPS=${3:-16}
cd "$(dirname "$0")/.."
W=${BENCH_WORK:-/tmp/gpu-restart}
rm -rf "$W" && mkdir -p "$W" "$R"
python3 - "$W" "$STEPS" <<'PY' || exit 1
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForImageTextToText

sys.path[:0] = ["tests", "tools"]
from make_tiny_model import make_tokenizer
from test_gpu import hybrid_config

work, steps = Path(sys.argv[1]), int(sys.argv[2])
tokenizer = make_tokenizer()
torch.manual_seed(0)
AutoModelForImageTextToText.from_config(hybrid_config(len(tokenizer))).save_pretrained(work / "model")
tokenizer.save_pretrained(work / "model")
job = yaml.safe_load(open("examples/cpu_smoke.yaml"))
job |= dict(model_name=str(work / "model"), compile=True, param_dtype="bfloat16", attn_implementation="torch_varlen")
job |= dict(max_steps=steps, save_every=5, async_save=False, log_every=1, collective_timeout_s=120)
for run in ("straight", "restarted"):
    (work / f"{run}.yaml").write_text(yaml.safe_dump(job | {"output_dir": str(work / run)}))
PY
torchrun --standalone --nproc_per_node="$NGPU" train.py --config "$W/straight.yaml" > "$R/straight.log" 2>&1 \
  || { echo "straight: exit $? (see $R/straight.log)"; exit 1; }
torchrun --standalone --nproc_per_node="$NGPU" --max-restarts=1 tests/workers/fault_worker.py "$W/restarted.yaml" \
  kill-rank0-once-at-7 > "$R/restarted.log" 2>&1 || { echo "restarted: exit $? (see $R/restarted.log)"; exit 1; }
for run in straight restarted; do
  echo "$run: $(grep -c '^checkpoint step' "$R/$run.log") saves; $(grep '^step ' "$R/$run.log" | tail -1 | cut -c1-60)"
done
grep -h "attempt 1 of 2 failed\|resumed from\|^exported" "$R/restarted.log"
ls -d "$W/restarted/nccl_traces" && cp "$W"/*/metrics.jsonl "$R"/ 2>/dev/null
python3 - "$W" <<'PY'
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

work = Path(sys.argv[1])


def losses(run):  # the last record of each step: a restarted run appends to the same metrics.jsonl
    return {r["step"]: r["loss"] for r in map(json.loads, open(work / run / "metrics.jsonl")) if "loss" in r}


def weights(run):
    return {k: v for f in sorted((work / run / "model").glob("*.safetensors")) for k, v in load_file(f).items()}


a, b = losses("straight"), losses("restarted")
assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
wa, wb = weights("straight"), weights("restarted")
diff = max((wb[k].float() - v.float()).abs().max().item() for k, v in wa.items())
print(f"restarted against straight: loss max |diff| {max(abs(a[s] - b[s]) for s in a):.3g} over steps 1-{max(a)}")
print(f"weights max |diff| {diff:.3g}")
PY
