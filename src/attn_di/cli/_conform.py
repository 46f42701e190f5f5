"""``attn-di conform TARGET``: the conformance kit's matrix on one backend.

Prints the capability table (features by outcome, declared vs. measured), then every failing
cell with its max error, tolerance, first wrong positions and the command that re-runs it
alone. Exit 0 when every declared cell is correct and every undeclared one is refused with a
typed error or correct; 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from attn_di.cli._output import print_json, print_table
from attn_di.exceptions import InvalidInputError

__all__ = ["run_conform"]

_OPTIONS = {"dtypes": "--dtype", "case id": "--case", "shard": "--shard"}


def run_conform(args: argparse.Namespace) -> int:
    """Run the matrix on ``args.target``; 0 if it conforms, 1 if not."""
    from attn_di.conformance import plan_conformance
    from attn_di.conformance._report import CAPABILITY_COLUMNS, capability_rows, cells

    try:
        plan = plan_conformance(
            args.target,
            full=args.full,
            seed=args.seed,
            dtypes=args.dtype or None,
            case_ids=args.case or None,
            shard=args.shard,
        )
    except InvalidInputError as error:  # name the options as the command line has them
        error.argument = _OPTIONS.get(error.argument, error.argument)
        raise
    started = time.perf_counter()
    with _Progress(len(plan), plan.driver.backend_name) as advance:
        report = plan.run(progress=advance)
    elapsed = time.perf_counter() - started
    if args.json:
        print_json(report.to_json())
    elif args.markdown:
        sys.stdout.write(report.to_markdown())
    else:
        title = (
            f"{report.backend_name} ({report.target}): {cells(len(report.results))}, "
            f"{report.matrix_name()}, seed {report.seed}"
        )
        print_table(title, CAPABILITY_COLUMNS, capability_rows(report.results))
        for result in report.failures():
            print(result.line())
            print(f"  rerun: {result.rerun}")
        counts = ", ".join(f"{n} {name}" for name, n in report.counts().items() if n)
        verdict = "conformant" if report.ok else f"NOT conformant: {len(report.failures())} failing"
        print(f"{report.backend_name}: {counts} in {elapsed:.1f} s: {verdict}")
    return 0 if report.ok else 1


class _Progress:
    """A transient rich progress bar on a terminal's stderr; a no-op elsewhere."""

    def __init__(self, total: int, name: str) -> None:
        self.total = total
        self.name = name
        self._bar: Any = None

    def __enter__(self) -> Any:
        def quiet(result: Any, done: int, total: int) -> None:
            return None

        try:
            from rich.progress import Progress
        except ImportError:
            return quiet
        if not sys.stderr.isatty():
            return quiet
        from rich.console import Console

        self._bar = Progress(transient=True, console=Console(stderr=True))
        self._bar.__enter__()
        task = self._bar.add_task(f"conform {self.name}", total=self.total)

        def advance(result: Any, done: int, total: int) -> None:
            self._bar.update(task, completed=done, description=f"{result.case.id[:48]}")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
