#!/usr/bin/env bash
# Creates .venv with the pinned packages (requirements-dev.txt: the recipe's plus pytest and ruff).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
