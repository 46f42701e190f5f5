#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every gate and test, failing on the first red one; then
# the tests against the real vLLM (tests/vllm) in their own venv (scripts/setup-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
echo "== ruff check";        $PY -m ruff check src tests examples benchmarks scripts
echo "== ruff format";       $PY -m ruff format --check src tests examples benchmarks scripts
echo "== mypy --strict src"; $PY -m mypy --strict src
echo "== mypy examples";     $PY -m mypy --strict examples/engine
                             $PY -m mypy --strict examples/tiny_llm
                             $PY -m mypy --strict examples/smollm2
echo "== mkdocs build --strict"
                             NO_MKDOCS_2_WARNING=1 $PY -m mkdocs build --strict --quiet --site-dir site
# tests/test_docs.py reads the site just built instead of building its own
echo "== pytest";            ATTN_DI_DOCS_SITE="$PWD/site" \
                             $PY -m pytest -q tests --hypothesis-profile=ci "$@"
echo "== vLLM: tests/vllm in .venv-vllm"
vllm_start=$SECONDS
bash scripts/setup-vllm.sh
.venv-vllm/bin/python -m pytest -q tests/vllm -p no:cacheprovider
echo "== vLLM part: $((SECONDS - vllm_start)) s (set-up included)"
