#!/usr/bin/env bash
# The whole GPU round on one nvidia-h200-x2 machine (docs/BENCHMARKS.md), results under $1 (default $OUT):
#   lane GPU0: the recipe, 1 GPU, 32k then 16k blocks     lane GPU1: tests/test_gpu.py, then the seed, 1 GPU, 16k
#   then both GPUs: the recipe and the seed at 32k (and at 16k if the seed does not fit at 32k)
# Assumes the device packages are installed (.device-deps) and .bench-assets is in place (see run_bench.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:-$OUT}
STEPS=${BENCH_STEPS:-8}
export PYTHONUNBUFFERED=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-170}
[ -s .bench-assets/tok/tokenizer.json ] || xz -dc .bench-assets/tokenizer.json.xz > .bench-assets/tok/tokenizer.json
(
  CUDA_VISIBLE_DEVICES=1 GPU_TEST_REPORT=$R/gpu_tests.jsonl timeout 200 \
    python3 -m pytest -s -v -p no:cacheprovider tests/test_gpu.py > "$R/gpu_tests.txt" 2>&1
  CUDA_VISIBLE_DEVICES=1 BENCH_WORK=/tmp/b1s BENCH_KINDS=seed bash bench/run_bench.sh 1 8 16384 "$STEPS" \
    > "$R/seed_1gpu.txt" 2>&1
) &
CUDA_VISIBLE_DEVICES=0 BENCH_WORK=/tmp/b1o BENCH_KINDS=ours bash bench/run_bench.sh 1 8 "32768 16384" "$STEPS" \
  > "$R/ours_1gpu.txt" 2>&1
wait
BENCH_WORK=/tmp/b2 bash bench/run_bench.sh 2 8 "32768 16384" "$STEPS" > "$R/bench_2gpu.txt" 2>&1
mkdir -p /tmp/ball && cat /tmp/b1o/runs.tsv /tmp/b1s/runs.tsv /tmp/b2/runs.tsv > /tmp/ball/runs.tsv
python3 bench/bench.py summary /tmp/ball --out "$R/bench_summary.json" 2>&1 | tee "$R/summary.txt"
