#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the example engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/engine/engine.py
