"""README.md as tested code: every ```python block runs as written (pytest-markdown-docs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_fences() -> list[tuple[str, str]]:
    """``(info string, text before the block)`` of every Python fence in the README."""
    tokens = MarkdownIt("commonmark").parse(README.read_text())
    fences = []
    for index, token in enumerate(tokens):
        if token.type == "fence" and token.info.split()[:1] == ["python"]:
            before = " ".join(t.content for t in tokens[max(0, index - 4) : index])
            fences.append((token.info, before))
    return fences


def test_every_python_block_in_the_readme_runs() -> None:
    """pytest --markdown-docs runs each ```python block (scripts and test modules included)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--markdown-docs", "-p", "tests.readme_plugin",
         "-p", "no:cacheprovider", "-q", "README.md"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    runnable = [info for info, _ in _python_fences() if "notest" not in info.split()]
    assert len(runnable) >= 10
    assert re.search(rf"\b{len(runnable)} passed\b", result.stdout), result.stdout


def test_blocks_that_do_not_run_are_marked_as_sketches() -> None:
    """A ```python notest block is introduced as a sketch in the text right before it."""
    for info, before in _python_fences():
        if "notest" in info.split():
            assert "sketch" in before.lower(), before
