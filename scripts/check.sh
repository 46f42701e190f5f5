#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every gate and test, failing on the first red one; then
# the tests against the real vLLM (tests/vllm) in their own venv (scripts/setup-vllm.sh, which
# runs in the background from the start, so its download overlaps the other gates).
# Each gate prints its time; the last line says that all of them passed, or which one failed.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
START=$SECONDS
PASSED=0
CURRENT="set-up (scripts/setup.sh)"
trap 'echo "check.sh: FAILED at $CURRENT after $((SECONDS - START)) s ($PASSED gate(s) passed before it)" >&2' ERR

gate() {  # gate NAME COMMAND...: run one gate, then print how long it took
    CURRENT="gate '$1'"
    local name=$1 start=$SECONDS
    shift
    echo "== $name"
    "$@"
    PASSED=$((PASSED + 1))
    echo "== $name: passed in $((SECONDS - start)) s"
}

mypy_examples() {  # one run per example folder: their module names overlap
    for folder in examples/engine examples/tiny_llm examples/smollm2; do
        "$PY" -m mypy --strict "$folder"
    done
}

# .venv-vllm is made in the background while the gates run (its set-up is mostly download and
# unpacking): its output is kept in a log, shown when the vLLM gate waits for it.
VLLM_SETUP_LOG=$(mktemp "${TMPDIR:-/tmp}/attn_di-setup-vllm.XXXXXX")
VLLM_SETUP_PID=
vllm_tests() {  # the vLLM suite in its own venv, after its set-up has finished
    local status=0
    wait "$VLLM_SETUP_PID" || status=$?
    cat "$VLLM_SETUP_LOG"
    if [ "$status" -ne 0 ]; then
        echo "check.sh: scripts/setup-vllm.sh failed (exit $status); its output is above" >&2
        return "$status"
    fi
    .venv-vllm/bin/python -m pytest -q tests/vllm -p no:cacheprovider
}

bash scripts/setup.sh
echo "== set-up: $((SECONDS - START)) s"
setsid bash scripts/setup-vllm.sh >"$VLLM_SETUP_LOG" 2>&1 &
VLLM_SETUP_PID=$!
# A red gate ends the run: the background set-up (its own process group) ends with it.
trap 'kill -- "-$VLLM_SETUP_PID" 2>/dev/null || true; rm -f "$VLLM_SETUP_LOG"' EXIT
gate "ruff check"              "$PY" -m ruff check src tests examples benchmarks scripts
gate "ruff format"             "$PY" -m ruff format --check src tests examples benchmarks scripts
gate "mypy --strict src"       "$PY" -m mypy --strict src
gate "mypy --strict examples"  mypy_examples
gate "mkdocs build --strict"   env NO_MKDOCS_2_WARNING=1 \
                               "$PY" -m mkdocs build --strict --quiet --site-dir site
# tests/test_docs.py reads the site just built instead of building its own
gate "pytest"                  env ATTN_DI_DOCS_SITE="$PWD/site" \
                               "$PY" -m pytest -q tests --hypothesis-profile=ci "$@"
gate "vLLM: tests/vllm in .venv-vllm (set-up included)" vllm_tests
echo "check.sh: all $PASSED gates passed in $((SECONDS - START)) s (set-up included)"
