#!/usr/bin/env bash
# The recipe with different settings, one run each, on the same machine, geometry, data and block length:
#
#   bash bench/run_variants.sh NGPUS LAYERS SEQ STEPS "NAME=ARGS" ["NAME=ARGS" ...]
#
# ARGS are extra `bench.py ours` arguments, e.g. "half=--set activation_checkpointing=0.5"; "default=" runs the
# recipe's defaults. A variant that fails (out of memory, say) is recorded and the next one runs. Runs are
# appended to $BENCH_WORK/runs.tsv (see run_bench.sh, whose environment variables apply); then the summary.
# BENCH_DEADLINE (epoch seconds): variants not started by then are skipped (a device call has 10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
NGPU=$1 LAYERS=$2 SEQ=$3 STEPS=$4
shift 4
for SPEC in "$@"; do
  if [ -n "${BENCH_DEADLINE:-}" ] && [ "$(date +%s)" -gt "$BENCH_DEADLINE" ]; then
    echo "=== skipped ${SPEC%%=*}: past BENCH_DEADLINE"
    continue
  fi
  BENCH_KINDS=ours BENCH_VARIANT=${SPEC%%=*} BENCH_OURS_ARGS=${SPEC#*=} BENCH_NO_SUMMARY=1 \
    bash bench/run_bench.sh "$NGPU" "$LAYERS" "$SEQ" "$STEPS"
done
python3 bench/bench.py summary "${BENCH_WORK:-/tmp/bench}" ${BENCH_SUMMARY:+--out "$BENCH_SUMMARY"}
