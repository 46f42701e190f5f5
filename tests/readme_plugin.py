"""A pytest plugin that runs README.md's Python blocks (loaded by tests/test_readme.py with -p).

pytest-markdown-docs collects every ```` ```python ```` block (``notest`` ones excepted) and by
default runs it in this process; this plugin gives each such block a fresh default container
and a clean ``ATTN_DI_*`` environment, and adds two runners a block selects in its info string:

- ``runner:ScriptRunner``: the block is a script: it runs as ``python block.py`` in a fresh
  process (``__name__ == "__main__"``: wiring ``modules=[__name__]``, spawn pools, Ray);
- ``runner:PytestRunner``: the block is a test module: pytest runs it, and it must pass.

The runner API is pytest-markdown-docs 0.9's (``pytest_markdown_docs._runners``), pinned in
pyproject's test extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from pytest_markdown_docs._runners import DefaultRunner, register_runner
from pytest_markdown_docs.definitions import FenceTestDefinition

from attn_di import BackendContainer

TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _fresh_backends(attn_di_container: BackendContainer) -> BackendContainer:
    """Each block run in this process gets a fresh default container (nothing leaks between)."""
    return attn_di_container


def _run_block(test: FenceTestDefinition, filename: str, command: list[str]) -> None:
    """Write the block to ``filename`` in a new directory and run ``command`` + that file there.

    The block keeps its README line numbers (pytest-markdown-docs pads it with blank lines),
    so a traceback points at README.md's lines. Raises AssertionError with the output on failure.
    """
    env = {name: value for name, value in os.environ.items() if not name.startswith("ATTN_DI_")}
    with tempfile.TemporaryDirectory(prefix="readme-block-") as directory:
        path = Path(directory, filename)
        path.write_text(test.source)
        result = subprocess.run(
            [*command, str(path)],
            cwd=directory,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    if result.returncode != 0:
        where = f"{Path(test.source_path).name} line {test.start_line}"
        raise AssertionError(
            f"{where}: `{' '.join(command)} {filename}` exited with {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )


@register_runner()
class ScriptRunner(DefaultRunner):
    """Runs a block as a script in a fresh Python process."""

    def runtest(self, test: FenceTestDefinition, args: dict[str, Any], **kwargs: Any) -> None:
        _run_block(test, "readme_block.py", [sys.executable])


@register_runner()
class PytestRunner(DefaultRunner):
    """Runs a block as a test module under pytest in a fresh process; every test must pass."""

    def runtest(self, test: FenceTestDefinition, args: dict[str, Any], **kwargs: Any) -> None:
        _run_block(
            test,
            "test_readme_block.py",
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-W", "error::attn_di.exceptions.AttnDIWarning"],
        )  # fmt: skip
