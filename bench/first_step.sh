#!/usr/bin/env bash
# Launch to step 2's log line on a fresh machine, then on a restart that keeps only output_dir (issue 25, target 5):
# the same command twice, the machine's default kernel caches removed before each, as a new container has none.
# The caches under test go to output_dir (TRITON_CACHE_DIR=$W/out/caches/triton, as a run would keep them on its
# volume). Run after `source bench/device_env.sh`, without its restored caches. Logs: $W (BENCH_LOGS: also there).
#
#   bash bench/first_step.sh [SEQ_LEN] [STEPS] [LAYERS]
set -uo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:-16384} STEPS=${2:-3} LAYERS=${3:-8}
A=${BENCH_ASSETS:-.bench-assets} W=${BENCH_WORK:-/tmp/first_step}
unset TORCHINDUCTOR_CACHE_DIR
export TRITON_CACHE_DIR=$W/out/caches/triton
rm -rf "$W" && mkdir -p "$W"
[ -s "$A/tok/tokenizer.json" ] || xz -dc "$A/tokenizer.json.xz" > "$A/tok/tokenizer.json" || exit 1
python3 bench/bench.py data "$A/ultrachat_200.jsonl" "$W/data.jsonl" --copies 40 || exit 1
for RUN in fresh restart; do
  rm -rf ~/.triton "/tmp/torchinductor_$(whoami)"  # what a new container lacks; output_dir stays
  T0=$(($(date +%s%N) / 1000000))
  timeout "${BENCH_TIMEOUT:-300}" torchrun --standalone --nproc_per_node=1 bench/bench.py ours \
    --model-config "bench/configs/qwen3.8-27b-geometry-${LAYERS}layers" --tokenizer "$A/tok" --data "$W/data.jsonl" \
    --seq-len "$SEQ" --steps "$STEPS" --attn torch_varlen --out "$W/out" 2>&1 |
    while IFS= read -r line; do echo "$(($(date +%s%N) / 1000000 - T0)) $line"; done > "$W/$RUN.log"
  [ -n "${BENCH_LOGS:-}" ] && cp "$W/$RUN.log" "$BENCH_LOGS/"  # what a call cut short still brings back
  for STEP in 1 2; do
    grep -m1 " step $STEP/$STEPS " "$W/$RUN.log" | awk -v r="$RUN" -v s="$STEP" '{printf "%s: step %s logged %.1f s after launch\n", r, s, $1 / 1000}'
  done
  grep -m1 "model: " "$W/$RUN.log" | awk -v r="$RUN" '{printf "%s: model ready %.1f s after launch\n", r, $1 / 1000}'
done
du -sh "$W/out/caches/triton" 2>/dev/null
