#!/usr/bin/env bash
# Sets up and runs the test suite (CPU; GPU tests skip without CUDA), in two processes, a test file to each: many
# tests wait on timeouts and restarts, so two files at once fill the 2 cores that CI has.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
