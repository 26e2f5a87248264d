#!/usr/bin/env bash
# Sets up and runs the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
