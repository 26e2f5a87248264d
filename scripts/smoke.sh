#!/usr/bin/env bash
# The embedded default: sets up, builds the tiny model, and trains it on 2 CPU ranks on the bundled data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python tools/make_tiny_model.py .tiny-model
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 train.py --config examples/cpu_smoke.yaml "$@"
