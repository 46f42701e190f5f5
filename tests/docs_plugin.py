"""A pytest plugin that runs the Python blocks of README.md and docs/ (loaded by
tests/test_docs.py with ``-p``).

pytest-markdown-docs collects every ```` ```python ```` block (``notest`` ones excepted) and by
default runs it in this process; this plugin gives each such block a fresh default container
and a clean ``ATTN_DI_*`` environment, and reads more words of a block's info string:

- ``runner:ScriptRunner``: the block is a script: it runs as ``python block.py`` in a fresh
  process (``__name__ == "__main__"``: wiring ``modules=[__name__]``, spawn pools, Ray);
- ``runner:PytestRunner``: the block is a test module: pytest runs it, and it must pass;
- ``file:NAME``: the block is the file ``NAME`` of a tutorial: every such block of the page is
  written under its name into the directory where the page's script and test blocks run (so
  a test module can import the module the page wrote before it);
- ``vllm``: the block needs vLLM: skipped here, run by the vLLM suite (tests/vllm/, in its
  own virtual environment), which runs this plugin with ``ATTN_DI_DOCS_VLLM=1``: then only
  the ``vllm`` blocks run.

The site's MkDocs hook (scripts/mkdocs_hooks.py) renders these fences as plain ``python``.
The runner API is pytest-markdown-docs 0.9's (``pytest_markdown_docs._runners``), pinned in
pyproject's test extra.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from pytest_markdown_docs._runners import DefaultRunner, register_runner
from pytest_markdown_docs.definitions import FenceTestDefinition

from attn_di import BackendContainer

TIMEOUT_S = 300
VLLM_WORD = "vllm"
ONLY_VLLM_ENV = "ATTN_DI_DOCS_VLLM"


@pytest.fixture(autouse=True)
def _fresh_backends(attn_di_container: BackendContainer) -> BackendContainer:
    """Each block run in this process gets a fresh default container (nothing leaks between)."""
    return attn_di_container


@functools.cache
def fences(path: str) -> dict[int, tuple[list[str], str]]:
    """``{first code line: (info words, code)}`` of every fence of the Markdown file ``path``
    (the line numbers pytest-markdown-docs gives its tests)."""
    tokens = MarkdownIt("commonmark").parse(Path(path).read_text())
    return {
        token.map[0] + 1: (token.info.split(), token.content)
        for token in tokens
        if token.type == "fence" and token.map
    }


def info_words(test: FenceTestDefinition) -> list[str]:
    """The info string words of the fence ``test`` runs."""
    return fences(str(test.source_path)).get(test.start_line, ([], ""))[0]


def _option(words: list[str], prefix: str) -> str | None:
    return next((word[len(prefix) :] for word in words if word.startswith(prefix)), None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip the blocks marked ``vllm`` (the vLLM suite runs them); with ``ATTN_DI_DOCS_VLLM=1``
    (the vLLM suite, in its own environment) run only those and skip the others."""
    only_vllm = os.environ.get(ONLY_VLLM_ENV) == "1"
    for item in items:
        test = getattr(item, "test_definition", None)
        if not isinstance(test, FenceTestDefinition):
            continue
        needs_vllm = VLLM_WORD in info_words(test)
        if needs_vllm and not only_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM: tests/vllm/ runs this block"))
        elif only_vllm and not needs_vllm:
            item.add_marker(pytest.mark.skip(reason="not a vLLM block: tests/test_docs.py runs it"))


def _run_block(test: FenceTestDefinition, filename: str, command: list[str]) -> None:
    """Write the block to ``filename`` in a new directory (with the page's ``file:`` blocks)
    and run ``command`` + that file there.

    The block keeps its page's line numbers (pytest-markdown-docs pads it with blank lines),
    so a traceback points at the Markdown file's lines. Raises AssertionError with the output
    on failure.
    """
    env = {name: value for name, value in os.environ.items() if not name.startswith("ATTN_DI_")}
    filename = _option(info_words(test), "file:") or filename
    with tempfile.TemporaryDirectory(prefix="docs-block-") as directory:
        for words, code in fences(str(test.source_path)).values():
            name = _option(words, "file:")
            if name is not None:
                Path(directory, name).write_text(code)
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
        _run_block(test, "docs_block.py", [sys.executable])


@register_runner()
class PytestRunner(DefaultRunner):
    """Runs a block as a test module under pytest in a fresh process; every test must pass."""

    def runtest(self, test: FenceTestDefinition, args: dict[str, Any], **kwargs: Any) -> None:
        _run_block(
            test,
            "test_docs_block.py",
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-W", "error::attn_di.exceptions.AttnDIWarning"],
        )  # fmt: skip
