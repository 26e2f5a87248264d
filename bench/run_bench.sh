#!/usr/bin/env bash
# The recipe against the seed recipe on this machine: same geometry, tokenizer, data, block length, GPU count and
# attention backend (torch_varlen); with BENCH_KINDS="ours seed trl", TRL's SFTTrainer too (bench/trl_peer.py, TRL
# installed: .device-deps/peers/trl-*.whl). Results and method: docs/BENCHMARKS.md.
#
#   bash bench/run_bench.sh NGPUS LAYERS "SEQ_LENS" STEPS
#
# For each block length in SEQ_LENS, in order: the recipe, then the seed. The loop stops after the first length
# at which the seed runs (the seed forms full-vocabulary logits and may not fit at 32k): list 32768 first and
# shorter fallbacks after it. Runs are appended to $BENCH_WORK/runs.tsv; the table comes from `bench.py summary`.
#
# Environment: BENCH_ASSETS (default .bench-assets) holds tok/ (tokenizer files; tokenizer.json is unpacked from
# tokenizer.json.xz beside it if missing) and ultrachat_200.jsonl; the seed is bench/baseline/seed_train.py. BENCH_WORK (default
# /tmp/bench), BENCH_COPIES (40 shuffled copies of the 200 conversations), BENCH_KINDS ("ours seed"),
# BENCH_OURS_ARGS (extra `bench.py ours` arguments, e.g. "--set activation_checkpointing=0.5"), BENCH_VARIANT
# (the name the summary gives those settings, default "default"),
# BENCH_TIMEOUT (seconds per run, 300), BENCH_ATTN (torch_varlen), BENCH_SUMMARY (also write the summary JSON there),
# BENCH_NO_SUMMARY (set: print no summary, for scripts that run several cases), BENCH_TRL_ARGS (extra
# `trl_peer.py run` arguments, e.g. "--attn sdpa"), BENCH_TRL_VARIANT (their name in the summary, default "trl") and
# BENCH_REPEAT (run the kinds in turn this many times, default 1: the summary then gives each one's mean as well, since
# one machine's runs of the seed alone differ by a few percent; the repeats' directories end in _r2, _r3, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
NGPU=$1 LAYERS=$2 SEQS=$3 STEPS=$4
A=${BENCH_ASSETS:-.bench-assets}
W=${BENCH_WORK:-/tmp/bench}
COPIES=${BENCH_COPIES:-40}
mkdir -p "$W"
[ -s "$A/tok/tokenizer.json" ] || xz -dc "$A/tokenizer.json.xz" > "$A/tok/tokenizer.json" || exit 1
DATA=$W/ultrachat_x$COPIES.jsonl
[ -s "$DATA" ] || python3 bench/bench.py data "$A/ultrachat_200.jsonl" "$DATA" --copies "$COPIES" || exit 1
CFG=bench/configs/qwen3.8-27b-geometry-${LAYERS}layers
export PYTHONUNBUFFERED=1
# Both recipes' workloads set expandable segments; a value given here (e.g. expandable_segments:False) wins.
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
for SEQ in $SEQS; do
  SEED_RC=1
  for REPEAT in $(seq "${BENCH_REPEAT:-1}"); do  # the kinds in turn, again: ours, seed, ours, seed, ...
    for KIND in ${BENCH_KINDS:-ours seed}; do
      VARIANT=${BENCH_VARIANT:-default}
      case $KIND in seed) VARIANT=seed ;; trl) VARIANT=${BENCH_TRL_VARIANT:-trl} ;; esac
      RUN=$W/${KIND}_${VARIANT}_g${NGPU}_l${LAYERS}_s${SEQ}$([ "$REPEAT" -gt 1 ] && echo "_r$REPEAT")
      rm -rf "$RUN" && mkdir -p "$RUN"
      echo "=== $KIND: $NGPU GPU(s), $LAYERS layers, $SEQ-token blocks, $STEPS steps ($(date -u +%FT%TZ))"
      LAUNCH=$(date +%s.%N)
      if [ "$KIND" = ours ]; then
        timeout "${BENCH_TIMEOUT:-300}" torchrun --standalone --nproc_per_node="$NGPU" bench/bench.py ours \
          --model-config "$CFG" --tokenizer "$A/tok" --data "$DATA" --seq-len "$SEQ" --steps "$STEPS" \
          --attn "${BENCH_ATTN:-torch_varlen}" --out "$RUN" ${BENCH_OURS_ARGS:-} 2>&1 | tee "$RUN/log.txt"
        RC=${PIPESTATUS[0]}
      elif [ "$KIND" = trl ]; then
        # One GPU: one process, as TRL is run there; several: torchrun, Trainer's DDP.
        if [ "$NGPU" = 1 ]; then LAUNCHER=(python3); else LAUNCHER=(torchrun --standalone --nproc_per_node="$NGPU"); fi
        timeout "${BENCH_TIMEOUT:-300}" "${LAUNCHER[@]}" bench/trl_peer.py run \
          --model-config "$CFG" --tokenizer "$A/tok" --data "$DATA" --seq-len "$SEQ" --steps "$STEPS" \
          --attn "${BENCH_ATTN:-torch_varlen}" --out "$RUN" ${BENCH_TRL_ARGS:-} 2>&1 | tee "$RUN/log.txt"
        RC=${PIPESTATUS[0]}
      else
        BENCH_MODEL_CONFIG=$CFG BENCH_TOKENIZER=$A/tok BENCH_DATA=$DATA BENCH_SEQ_LEN=$SEQ BENCH_ATTN=${BENCH_ATTN:-torch_varlen} \
          BENCH_MAX_STEPS=$STEPS BENCH_WARMUP=2 timeout "${BENCH_TIMEOUT:-300}" \
          torchrun --standalone --nproc_per_node="$NGPU" bench/bench.py seed bench/baseline/seed_train.py 2>&1 | tee "$RUN/log.txt"
        RC=${PIPESTATUS[0]}
        SEED_RC=$RC
      fi
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$KIND" "$NGPU" "$LAYERS" "$SEQ" "$RUN" "$LAUNCH" "$RC" "$VARIANT" \
        >> "$W/runs.tsv"
    done
  done
  [ "$SEED_RC" = 0 ] && break
done
[ -n "${BENCH_NO_SUMMARY:-}" ] || python3 bench/bench.py summary "$W" ${BENCH_SUMMARY:+--out "$BENCH_SUMMARY"}
