"""``attn-di conform``, run as a user would: the table, the exit code, the rerun line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BF16_LONG = "bf16-gqa2-decode-len8192-block16"
ACCUMULATING = "tests.conformance.kit_backends:Bf16AccumulatingBackend"


def conform(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m attn_di conform ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "attn_di", "conform", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_a_conformant_backend_exits_0_with_its_table() -> None:
    """Two cells of CPU_ATTN: the capability table, a summary line, exit 0."""
    result = conform("CPU_ATTN", "--case", "fp32-gqa2-decode-len40-block16",
                     "--case", "bf16-gqa4-mixed-len19-window6-block16")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "CPU_ATTN (CPU_ATTN): 2 cells, default matrix, seed 0"
    assert lines[1].split()[:3] == ["feature", "declared", "cells"]
    assert any(line.split()[:4] == ["window", "yes", "1", "1"] for line in lines)
    assert lines[-1].startswith("CPU_ATTN: 2 pass in ")
    assert lines[-1].endswith(": conformant")


def test_a_failing_cell_prints_its_error_and_a_rerun_line_that_reproduces_it() -> None:
    """Exit 1; the FAIL line has max error, tolerance and positions; its rerun command,
    run as printed, gives the same numbers."""
    result = conform(ACCUMULATING, "--case", BF16_LONG, "--case", "bf16-gqa2-decode-len40-block16")
    assert result.returncode == 1, result.stderr
    fail = next(line for line in result.stdout.splitlines() if line.startswith("FAIL "))
    assert fail.startswith(f"FAIL {BF16_LONG}: max error ")
    assert "first wrong (token, head, dim): (0, 0, 0)" in fail
    rerun = f"attn-di conform {ACCUMULATING} --case {BF16_LONG} --seed 0"
    assert f"  rerun: {rerun}" in result.stdout
    assert "NOT conformant: 1 failing" in result.stdout.splitlines()[-1]
    again = conform(*shlex.split(rerun)[2:], "--json")
    assert again.returncode == 1
    (cell,) = json.loads(again.stdout)["results"]
    assert cell["outcome"] == "fail"
    assert f"max error {cell['max_error']:.3g} (tolerance {cell['tolerance']:.3g})" in fail


def test_markdown() -> None:
    """--markdown: the report as Markdown, for docs (--json is in the rerun test)."""
    case = "fp16-gqa1-prefill-len19-block16"
    markdown = conform("TORCH_SDPA", "--case", case, "--markdown")
    assert markdown.returncode == 0, markdown.stderr
    assert markdown.stdout.startswith("### TORCH_SDPA (`TORCH_SDPA`)\n")
    assert "| prefill | yes | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in markdown.stdout


def test_bad_names_are_one_line_and_a_hint() -> None:
    """An unknown member and a mistyped case id: exit 2, the closest name suggested."""
    unknown = conform("CPU_ATN")
    assert unknown.returncode == 2
    assert "Traceback" not in unknown.stderr
    assert "hint: did you mean 'CPU_ATTN'?" in unknown.stderr
    bad_case = conform("CPU_ATTN", "--case", "bf16-gqa2-decod-len40")
    assert bad_case.returncode == 2
    assert "unknown token 'decod'" in bad_case.stderr
    assert "hint: did you mean 'decode'?" in bad_case.stderr
