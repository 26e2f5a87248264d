#!/usr/bin/env bash
# The 8-GPU run, in one command on an 8xH200 machine: the full 64-layer Qwen3.8-27B geometry,
# random init, 32,768-token blocks, 8 ranks, the recipe's defaults against the seed recipe, then the recipe
# again with each GPU capped at 80 GiB (torch.cuda.set_per_process_memory_fraction) to see whether an 8xH100
# node could take 32k blocks. Results under $1 (default $OUT); the table is in summary.txt.
#
# The capped runs test docs/BENCHMARKS.md "Memory": predicted 81.8 GiB per GPU with the default fp32 master weights
# (over the cap) and 56.7 GiB with master_dtype bfloat16 (under it).
#
# Command (with .device-deps and .bench-assets in place, as in docs/BENCHMARKS.md):
#   source bench/device_env.sh && bash bench/run_h200x8.sh $OUT
# Budget: without the carried caches a machine autotunes fla's kernels for minutes before step 1, so the first
# run gets the longest timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:-$OUT}
STEPS=${BENCH_STEPS:-6}
export PYTHONUNBUFFERED=1
python3 -c "import torch, causal_conv1d_cuda, fla" || exit 1
BENCH_TIMEOUT=300 BENCH_WORK=/tmp/b8 bash bench/run_bench.sh 8 64 32768 "$STEPS" > "$R/bench_8gpu.txt" 2>&1
BENCH_TIMEOUT=150 BENCH_WORK=/tmp/b8cap BENCH_MEMORY_CAP_GIB=80 \
  bash bench/run_variants.sh 8 64 32768 "$STEPS" "cap80=" "cap80-bf16=--set master_dtype=bfloat16" \
  > "$R/bench_8gpu_80gib.txt" 2>&1
mkdir -p /tmp/b8all && cat /tmp/b8/runs.tsv /tmp/b8cap/runs.tsv > /tmp/b8all/runs.tsv
echo "rows in order: the recipe, the seed, the recipe with each GPU capped at 80 GiB (fp32, then bf16 masters)" \
  | tee "$R/summary.txt"
python3 bench/bench.py summary /tmp/b8all --out "$R/bench_summary.json" 2>&1 | tee -a "$R/summary.txt"
