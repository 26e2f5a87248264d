#!/usr/bin/env bash
# Launch to step 2's log line (issues 25 target 5, 26 target 5): for each block length, the same command three times,
# the kernel caches in $W/caches (TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR point there):
#   fresh             the first length's with no cache, as a new container (a later length's finds the kernels
#                     compiled at the lengths before it, as a job resubmitted with a new max_seq_len would);
#   restart           with Triton's and Inductor's caches from the runs before: what workload.yaml keeps (their
#                     archives in KERNEL_CACHE, restored to local disk);
#   restart_triton    with Triton's only.
# Fresh runs print Triton's autotuning (TRITON_PRINT_AUTOTUNING=1): where step 1's time goes. Run after
# `source bench/device_env.sh` without its restored caches (remove .bench-assets/caches.tar.xz.part* first).
# Logs: $W, and BENCH_LOGS if set (what a call cut short still returns). BENCH_OURS_ARGS: extra `bench.py ours`
# arguments, e.g. "--set compile=false".
#
#   bash bench/first_step.sh ["SEQ_LENS"] [STEPS] [LAYERS]
set -uo pipefail
cd "$(dirname "$0")/.."
SEQS=${1:-16384} STEPS=${2:-3} LAYERS=${3:-8}
A=${BENCH_ASSETS:-.bench-assets} W=${BENCH_WORK:-/tmp/first_step}
export TRITON_CACHE_DIR=$W/caches/triton TORCHINDUCTOR_CACHE_DIR=$W/caches/inductor
rm -rf "$W" && mkdir -p "$W"
[ -s "$A/tok/tokenizer.json" ] || xz -dc "$A/tokenizer.json.xz" > "$A/tok/tokenizer.json" || exit 1
python3 bench/bench.py data "$A/ultrachat_200.jsonl" "$W/data.jsonl" --copies 40 || exit 1
for SEQ in $SEQS; do
  for RUN in ${BENCH_RUNS:-fresh restart restart_triton}; do
    NAME=s${SEQ}_$RUN
    rm -rf "$W/out_$NAME"
    [ "$RUN" = fresh ] && [ "$SEQ" = "${SEQS%% *}" ] && rm -rf "$W/caches"  # the first length's: a new container
    [ "$RUN" = restart_triton ] && rm -rf "$TORCHINDUCTOR_CACHE_DIR"  # Triton's cache only
    T0=$(($(date +%s%N) / 1000000))
    PRINT=0 && [ "$RUN" = fresh ] && PRINT=1
    TRITON_PRINT_AUTOTUNING=$PRINT timeout "${BENCH_TIMEOUT:-300}" torchrun --standalone --nproc_per_node=1 \
      bench/bench.py ours --model-config "bench/configs/qwen3.8-27b-geometry-${LAYERS}layers" --tokenizer "$A/tok" \
      --data "$W/data.jsonl" --seq-len "$SEQ" --steps "$STEPS" --attn torch_varlen --out "$W/out_$NAME" \
      ${BENCH_OURS_ARGS:-} 2>&1 |
      while IFS= read -r line; do echo "$(($(date +%s%N) / 1000000 - T0)) $line"; done > "$W/$NAME.log"
    RC=${PIPESTATUS[0]}
    [ -n "${BENCH_LOGS:-}" ] && cp "$W/$NAME.log" "$BENCH_LOGS/"
    echo "$(python3 bench/first_step_times.py "$W/$NAME.log" "$STEPS") | exit status $RC" | tee -a "$W/summary.txt"
    [ -n "${BENCH_LOGS:-}" ] && cp "$W/summary.txt" "$BENCH_LOGS/"
  done
done
du -sh "$W/caches/triton" "$W/caches/inductor" 2>/dev/null
