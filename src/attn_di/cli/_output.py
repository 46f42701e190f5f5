"""Terminal output: rich tables when rich is installed and stdout is a terminal, else plain text."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["exit_if_command", "print_error", "print_json", "print_table"]


TABLE_WIDTH = 100
"""Columns a plain table fits by default (``attn-di list --wide``: no limit)."""


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    width: int | None = None,
    wrap: Sequence[int] = (),
) -> None:
    """A table: rich's on a terminal, aligned plain text otherwise (pipes, files, CI logs).

    Args:
        width: the plain table's width in characters; None: as wide as its cells.
        wrap: the columns (indices) that wrap, at dots, colons and spaces, to fit ``width``;
            the others keep their widths.
    """
    if sys.stdout.isatty() and _rich_available():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*(str(cell) for cell in row))
        Console(width=width).print(table)
        return
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [
        max([len(column), *(len(row[i]) for row in text_rows)]) for i, column in enumerate(columns)
    ]
    if width is not None:
        widths = _fit(widths, [len(column) for column in columns], wrap, width)
    print(title)
    print(_line(columns, widths))
    for row in text_rows:
        cells = [
            _wrap(cell, w) if i in wrap else [cell]
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        for depth in range(max(len(lines) for lines in cells)):
            print(_line([lines[depth] if depth < len(lines) else "" for lines in cells], widths))


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def _fit(widths: list[int], minimum: list[int], wrap: Sequence[int], width: int) -> list[int]:
    """Narrow the ``wrap`` columns (the narrowest keeps its width first) so the row fits."""
    free = width - 2 * (len(widths) - 1) - sum(w for i, w in enumerate(widths) if i not in wrap)
    fitted = list(widths)
    left = sorted(wrap, key=lambda i: widths[i])
    for position, index in enumerate(left):
        share = free // (len(left) - position)
        fitted[index] = max(min(widths[index], share), minimum[index])
        free -= fitted[index]
    return fitted


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken after dots, colons and spaces (a dotted
    path stays readable); a longer piece is cut."""
    import re

    lines = [""]
    for piece in re.findall(r"[^.: ]*[.: ]|[^.: ]+$", text):
        if len(lines[-1]) + len(piece.rstrip()) > width and lines[-1]:
            lines[-1] = lines[-1].rstrip()
            lines.append("")
        while len(lines[-1]) + len(piece) > width and len(piece.rstrip()) > width:
            cut = width - len(lines[-1])
            lines[-1] += piece[:cut]
            piece = piece[cut:]
            lines.append("")
        lines[-1] += piece
    return [line.rstrip() for line in lines if line.strip()] or [""]


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
