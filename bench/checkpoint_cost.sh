#!/usr/bin/env bash
# What a synchronous checkpoint costs the training run (docs/CHECKPOINTS.md, "Cost at scale"), measured with the
# recipe's own save, resume and export on the Qwen3.8-27B geometry (random init, fp32 master weights and AdamW
# state, as the default job keeps them):
#   1. train STEPS steps, saving every SAVE_EVERY steps (default 0: only the final checkpoint), then export model/
#      unless EXPORT=false; each save logs its size, time and the training stall;
#   2. unless RESUME=0: drop the page cache, resume from the last checkpoint and train one more step.
# ASYNC=false makes the saves synchronous (the stall is then the whole save). FREE_SHARDS=1 deletes each complete
# checkpoint's shards after the next step (bench.py --free-saved-shards), so that a disk holding one checkpoint
# can take several saves; the final save's checkpoint is kept, but if the last periodic save's write is still in
# flight when the run ends, the disk must hold both. COPIES: copies of the 200 bench conversations (default 10).
#
#   bash bench/checkpoint_cost.sh RESULTS_DIR [NGPU] [LAYERS] [STEPS]
#
# Needs the GPU machine's packages (source bench/device_env.sh), .bench-assets (tokenizer and data, see
# run_bench.sh) and free disk for one checkpoint (12 bytes per parameter) and the export (2 bytes per parameter)
# under $BENCH_WORK (default /tmp/ckpt).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:?results dir} NGPU=${2:-2} LAYERS=${3:-8} STEPS=${4:-4}
W=${BENCH_WORK:-/tmp/ckpt}
A=${BENCH_ASSETS:-.bench-assets}
mkdir -p "$W" "$R"
[ -s "$A/tok/tokenizer.json" ] || xz -dc "$A/tokenizer.json.xz" > "$A/tok/tokenizer.json" || exit 1
python3 bench/bench.py data "$A/ultrachat_200.jsonl" "$W/data.jsonl" --copies "${COPIES:-10}" || exit 1
ours() {
  torchrun --standalone --nproc_per_node="$NGPU" bench/bench.py ours \
    --model-config "bench/configs/qwen3.8-27b-geometry-${LAYERS}layers" --tokenizer "$A/tok" --data "$W/data.jsonl" \
    --seq-len 16384 --attn torch_varlen --out "$W/run" "$@"
}
df -h "$W" | tail -1
ours --steps "$STEPS" --set save_every="${SAVE_EVERY:-0}" --set export="${EXPORT:-true}" \
  --set async_save="${ASYNC:-true}" ${FREE_SHARDS:+--free-saved-shards} 2>&1 | tee "$R/save.log"
du -sb "$W"/run/checkpoints/step_* "$W"/run/model 2>/dev/null | tee "$R/sizes.txt"
ls -l "$W"/run/checkpoints/step_*/ | tee -a "$R/sizes.txt"
if [ "${RESUME:-1}" = 1 ]; then
  sync && echo 3 > /proc/sys/vm/drop_caches && echo "page cache dropped"
  ours --steps "$((STEPS + 1))" --set save_every=-1 --set export=false 2>&1 | tee "$R/resume.log"
fi
grep -h "^model:\|^async_save\|checkpoint step\|^exported\|^resumed from\|^step " "$R"/*.log
