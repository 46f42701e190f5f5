"""The README's two commands as a user reads their output: scripts/check.sh gives each gate's
time and a closing line, scripts/main.sh each part's time and "main: 4/4 parts passed";
scripts/setup.sh says first what it installs; the SmolLM2 example's answer ends a sentence.

The scripts run from a copy of themselves in a scratch tree whose set-up scripts and
interpreters are stand-ins (they exit 0, or 3 for the command named by ``FAIL``), so these
tests take a second and install nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = """#!/usr/bin/env bash
# A stand-in interpreter: fails (3) when its arguments contain $FAIL; prints 1 for a script
# read from stdin (main.sh's idle-core count); otherwise exits 0.
if [ -n "${FAIL:-}" ] && [[ "$*" == *"$FAIL"* ]]; then echo "stand-in: failing $*" >&2; exit 3; fi
if [ "${1:-}" = "-" ]; then cat >/dev/null; echo 1; fi
exit 0
"""


def _scratch(tmp_path: Path, script: str) -> Path:
    """A tree holding ``scripts/<script>`` and stand-ins for what it runs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    for name in ("setup.sh", "setup-vllm.sh"):
        (tmp_path / "scripts" / name).write_text("exit 0\n")
    for venv, program in [(".venv", "python"), (".venv", "attn-di"), (".venv-vllm", "python")]:
        path = tmp_path / venv / "bin" / program
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STAND_IN)
        path.chmod(0o755)
    return tmp_path


def _run(tree: Path, script: str, fail: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(tree / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FAIL": fail},
    )


CHECK_GATES = [
    "ruff check",
    "ruff format",
    "mypy --strict src",
    "mypy --strict examples",
    "mkdocs build --strict",
    "pytest",
    "vLLM: tests/vllm in .venv-vllm (set-up included)",
]


def test_check_times_each_gate_and_closes_with_all_passed(tmp_path: Path) -> None:
    """Every gate is announced, then reported passed with its seconds; the last line counts
    them all and gives the total."""
    result = _run(_scratch(tmp_path, "check.sh"), "check.sh")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"== set-up: \d+ s", lines[0])
    for gate in CHECK_GATES:
        assert f"== {gate}" in lines
        assert any(re.fullmatch(rf"== {re.escape(gate)}: passed in \d+ s", x) for x in lines)
    assert re.fullmatch(
        rf"check\.sh: all {len(CHECK_GATES)} gates passed in \d+ s \(set-up included\)", lines[-1]
    )


def test_check_names_the_gate_that_failed(tmp_path: Path) -> None:
    """A red gate stops the run with its exit status and one line naming it; nothing claims
    that everything passed."""
    result = _run(_scratch(tmp_path, "check.sh"), "check.sh", fail="mypy --strict src")
    assert result.returncode == 3
    assert "all" not in result.stdout.splitlines()[-1]
    assert re.search(
        r"check\.sh: FAILED at gate 'mypy --strict src' after \d+ s "
        r"\(2 gate\(s\) passed before it\)",
        result.stderr,
    ), result.stderr


def test_check_reports_a_failed_vllm_setup_at_the_vllm_gate(tmp_path: Path) -> None:
    """.venv-vllm is set up in the background; its failure stops the run at the vLLM gate
    with the set-up's own output and exit status, after the other gates passed."""
    tree = _scratch(tmp_path, "check.sh")
    (tree / "scripts" / "setup-vllm.sh").write_text("echo 'setup-vllm: no index'; exit 4\n")
    result = _run(tree, "check.sh")
    assert result.returncode == 4
    assert "setup-vllm: no index" in result.stdout
    assert "scripts/setup-vllm.sh failed (exit 4)" in result.stderr
    assert re.search(
        r"FAILED at gate 'vLLM: tests/vllm in \.venv-vllm \(set-up included\)' after \d+ s "
        rf"\({len(CHECK_GATES) - 1} gate\(s\) passed before it\)",
        result.stderr,
    ), result.stderr


def test_main_times_each_part_and_closes_with_the_count(tmp_path: Path) -> None:
    """Each of the four parts ends with its time; the last line: main: 4/4 parts passed."""
    result = _run(_scratch(tmp_path, "main.sh"), "main.sh")
    assert result.returncode == 0, result.stderr
    for part in range(1, 5):
        assert re.search(rf"\(part {part}/4 passed in \d+ s\)", result.stdout)
    last = result.stdout.splitlines()[-1]
    assert re.fullmatch(r"main: 4/4 parts passed in \d+ s \(set-up included\)", last), last


def test_main_names_the_part_that_failed(tmp_path: Path) -> None:
    """A failing part stops the job with one line naming it and how many passed before."""
    result = _run(_scratch(tmp_path, "main.sh"), "main.sh", fail="run --backend all")
    assert result.returncode == 3
    assert "parts passed in" not in result.stdout
    failed = r"main: part 3/4 FAILED after \d+ s \(2/4 parts passed before it\)"
    assert re.search(failed, result.stderr), result.stderr


def test_setup_says_first_what_it_installs_and_how_long_it_takes(tmp_path: Path) -> None:
    """The first line scripts/setup.sh prints, before any work, names what it installs and
    how long the first run takes (here the work then fails at once: no Python to make .venv)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    result = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": "false"},
    )
    assert result.returncode != 0
    assert not (tmp_path / ".venv").exists()
    first = result.stdout.splitlines()[0]
    assert first.startswith("setup: .venv with torch 2.13 (CPU), attn_di and its extras")
    assert re.search(r"\d+(-\d+)? minutes the first time", first), first


# -- the SmolLM2 example's answer ends where a sentence ends --------------------------


def _smollm2_example() -> ModuleType:
    pytest.importorskip("transformers")
    path = ROOT / "examples" / "smollm2" / "generate_smollm2.py"
    spec = importlib.util.spec_from_file_location("generate_smollm2", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Words:
    """A tokenizer stand-in: token id i decodes to WORDS[i]."""

    WORDS: ClassVar[list[str]] = [
        "<prompt>",
        "The",
        " capital",
        " is",
        " 3.5",
        " Paris.",
        " It",
        " is",
        " old!",
    ]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(self.WORDS[int(i)] for i in ids)


@pytest.mark.parametrize(("sentences", "stops_after"), [(1, 5), (2, 8)])
def test_smollm2_stops_at_the_end_of_a_sentence(sentences: int, stops_after: int) -> None:
    """The stop rule fires at the token that ends the N-th sentence, not at a decimal point
    inside one, and not before."""
    import torch

    example = _smollm2_example()
    stop = example.SentencesDone(_Words(), prompt_tokens=1, sentences=sentences)
    ids = list(range(len(_Words.WORDS)))
    fired = [bool(stop(torch.tensor([ids[: n + 1]]), None)[0]) for n in range(1, len(ids))]
    assert fired.index(True) + 1 == stops_after
