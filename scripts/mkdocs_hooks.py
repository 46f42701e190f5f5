"""MkDocs hooks of attn_di's documentation site (mkdocs.yml: ``hooks:``).

Before a page's Markdown is rendered:

- a fence's info string is cut to its language (```` ```python runner:ScriptRunner ````
  renders as ```` ```python ````): the words after it are for the tests that run the block
  (tests/docs_plugin.py), and Material's fences take no such words; ``file:NAME`` becomes
  the block's title;
- ``<!-- attn-di: modules PACKAGE -->`` becomes one mkdocstrings block (``::: module``) per
  public module of the package, found in ``src/`` (so a new backend module or integration
  subpackage, such as ``attn_di.integrations.vllm``, gets its reference without an edit);
- ``<!-- attn-di: help -->`` becomes the output of ``attn-di --help`` and of each command's
  ``--help``, run now with the interpreter that runs mkdocs (generated, never pasted).
"""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]+)[^\n]*$", re.MULTILINE
)
_MODULES = re.compile(r"^<!-- attn-di: modules (?P<package>[\w.]+) -->$", re.M)
_HELP = re.compile(r"^<!-- attn-di: help -->$", re.M)
HELP_COLUMNS = "100"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Expand the markers and cut the fences' info strings (see the module docstring)."""
    markdown = _MODULES.sub(lambda match: _module_blocks(match["package"]), markdown)
    markdown = _HELP.sub(lambda match: _help_blocks(), markdown)
    return _FENCE.sub(_plain_fence, markdown)


def _plain_fence(match: re.Match[str]) -> str:
    line = f"{match['indent']}{match['fence']}{match['lang']}"
    name = re.search(r"\bfile:(\S+)", match[0])
    return f'{line} title="{name[1]}"' if name else line


def public_modules(package: str) -> list[str]:
    """The public modules and subpackages of ``package`` (names not starting with ``_``),
    sorted, read from the source tree without importing anything."""
    directory = SRC.joinpath(*package.split("."))
    if not directory.is_dir():
        raise FileNotFoundError(f"attn-di: modules {package}: no package at {directory}")
    return [
        f"{package}.{module.name}"
        for module in sorted(pkgutil.iter_modules([str(directory)]), key=lambda m: m.name)
        if not module.name.startswith("_")
    ]


def _module_blocks(package: str) -> str:
    return "\n\n".join(f"::: {module}" for module in public_modules(package))


def _help_blocks() -> str:
    sections = []
    for command in ([], ["list"], ["select"], ["run"], ["conform"]):
        title = " ".join(["attn-di", *command, "--help"])
        text = _run_help(command)
        sections.append(f"### `{title}`\n\n```text\n{text.rstrip()}\n```")
    return "\n\n".join(sections)


def _run_help(command: list[str]) -> str:
    env = {**os.environ, "COLUMNS": HELP_COLUMNS, "PYTHONPATH": str(SRC)}
    env = {name: value for name, value in env.items() if not name.startswith("ATTN_DI_")}
    result = subprocess.run(
        [sys.executable, "-m", "attn_di", *command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"attn-di {' '.join(command)} --help failed:\n{result.stderr}")
    return result.stdout
