#!/usr/bin/env bash
# SIGTERM and resume on GPUs (docs/CHECKPOINTS.md), the path tests/test_checkpoint.py checks on CPU, here with the
# recipe's GPU settings: NCCL, compiled norms and MLPs, bf16 compute, torch_varlen attention, fla's Gated DeltaNet
# kernels and causal-conv1d, asynchronous checkpoints staged into pinned host buffers. The model is a small qwen3_5
# hybrid (tests/test_gpu.py's geometry: 3 Gated DeltaNet layers and a full-attention layer, random weights) with
# the tiny tokenizer; the data is the bundled sample, as in examples/cpu_smoke.yaml.
#   1. straight: STEPS steps, a checkpoint every 10, then the export;
#   2. again: the same run once more, for the GPU's run-to-run differences;
#   3. stopped: the same run, SIGTERM sent to torchrun once step STOP_AT is logged (every rank finishes its step,
#      saves and exits with 128 + 15), then the same command again: it resumes from that checkpoint and finishes.
# Prints where the run stopped and resumed, then the differences of the per-step losses and exported weights.
#
#   bash bench/gpu_stop_resume.sh RESULTS_DIR [NGPU] [STEPS] [STOP_AT]
#
# Needs the GPU machine's packages (source bench/device_env.sh) and, on Hopper with Triton < 3.7.1, tilelang.
set -uo pipefail
R=$(realpath -m "${1:?results dir}") NGPU=${2:-2} STEPS=${3:-40} STOP_AT=${4:-15}
cd "$(dirname "$0")/.."
[ "$STOP_AT" -lt "$STEPS" ] || { echo "STOP_AT must be below STEPS"; exit 2; }
W=${BENCH_WORK:-/tmp/stop-resume}
rm -rf "$W" && mkdir -p "$W" "$R"
python3 - "$W/model" <<'EOF' || exit 1
import sys

import torch
from transformers import AutoModelForImageTextToText

sys.path[:0] = ["tests", "tools"]
from make_tiny_model import make_tokenizer
from test_gpu import hybrid_config

tokenizer = make_tokenizer()
torch.manual_seed(0)
AutoModelForImageTextToText.from_config(hybrid_config(len(tokenizer))).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
EOF
job() {  # exec: a job started in the background is torchrun itself, which SIGTERM then reaches
  exec torchrun --standalone --nproc_per_node="$NGPU" train.py --config examples/cpu_smoke.yaml \
    --model_name "$W/model" --compile true --param_dtype bfloat16 --attn_implementation torch_varlen \
    --max_steps "$STEPS" --save_every 10 --log_every 1 --output_dir "$W/$1"
}
for run in straight again; do
  (job $run) > "$R/$run.log" 2>&1 || { echo "$run: exit $? (see $R/$run.log)"; exit 1; }
done
job stopped > "$R/stopped.log" 2>&1 &
launcher=$!
until grep -q "^step $STOP_AT/" "$R/stopped.log" || ! kill -0 $launcher 2>/dev/null; do sleep 0.1; done
kill -TERM $launcher
wait $launcher
status=$?
STOPPED=$(grep -o 'stopped by SIGTERM after step [0-9]*' "$R/stopped.log" | head -1 | grep -o '[0-9]*$')
[ -n "$STOPPED" ] || { echo "the run did not stop on SIGTERM (see $R/stopped.log)"; exit 1; }
echo "stopped: torchrun exit $status, stopped by SIGTERM after step $STOPPED"
(job stopped) > "$R/resumed.log" 2>&1 || { echo "resumed: exit $? (see $R/resumed.log)"; exit 1; }
echo "resumed: $(grep -o 'resumed from .*' "$R/resumed.log" | head -1)"
for run in straight again stopped; do cp "$W/$run/metrics.jsonl" "$R/$run.metrics.jsonl"; done
python3 - "$W" "$STOPPED" <<'EOF'
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

work, stopped = Path(sys.argv[1]), int(sys.argv[2])


def losses(run):  # the last record of each step: a resumed run appends to the same metrics.jsonl
    records = (json.loads(line) for line in open(work / run / "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def weights(run):
    return {k: v for f in sorted((work / run / "model").glob("*.safetensors")) for k, v in load_file(f).items()}


base, base_weights = losses("straight"), weights("straight")
print(f"{'against straight':<18s} {f'loss, steps <= {stopped}':>20s} {'loss, later steps':>20s} {'weights max |diff|':>20s}")
for run in ("again", "stopped"):
    other, other_weights = losses(run), weights(run)
    assert other.keys() == base.keys(), (run, sorted(set(other) ^ set(base)))
    before, after = ([abs(other[s] - base[s]) for s in base if (s <= stopped) == side] for side in (True, False))
    diff = max((other_weights[k].float() - v.float()).abs().max().item() for k, v in base_weights.items())
    print(f"{run:<18s} {max(before):>20.3g} {max(after):>20.3g} {diff:>20.3g}")
EOF
