"""Terminal output: rich tables when rich is installed and stdout is a terminal, else plain text."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["exit_if_command", "print_error", "print_json", "print_table"]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table: rich's on a terminal, aligned plain text otherwise (pipes, files, CI logs)."""
    if sys.stdout.isatty() and _rich_available():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*(str(cell) for cell in row))
        Console().print(table)
        return
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [
        max([len(column), *(len(row[i]) for row in text_rows)]) for i, column in enumerate(columns)
    ]
    print(title)
    header = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    print(header.rstrip())
    for row in text_rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _rich_available() -> bool:
    """rich comes with the ``attn_di[cli]`` extra; without it, plain text is still complete."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None


def print_json(payload: Any) -> None:
    """Machine-readable output on stdout."""
    json.dump(payload, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def print_error(message: str, hint: str | None) -> None:
    """One readable line (and a hint) on stderr: never a traceback."""
    first, *rest = message.splitlines() or [""]
    print(f"attn-di: error: {first}", file=sys.stderr)
    for line in rest:
        if not line.startswith("Hint:"):
            print(f"  {line}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def exit_if_command(error: Exception, hint: str | None) -> None:
    """In the ``attn-di`` command, report an error raised by ``import attn_di`` and exit 2.

    The command's own code cannot catch it (the package is imported before the command
    starts), so ``attn_di/__init__`` hands it here: one line and a hint instead of a traceback.
    Elsewhere (a library import) this returns and the caller re-raises.
    """
    import os

    argv = list(getattr(sys, "orig_argv", ()))
    by_module = any(
        arg == "-mattn_di" or (arg == "-m" and argv[i + 1 : i + 2] == ["attn_di"])
        for i, arg in enumerate(argv)
    )
    by_script = bool(sys.argv) and os.path.basename(sys.argv[0]) in ("attn-di", "attn-di.exe")
    if by_module or by_script:
        from attn_di.exceptions import AttnDIError

        print_error(error.message() if isinstance(error, AttnDIError) else str(error), hint)
        sys.exit(2)
