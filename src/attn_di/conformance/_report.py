"""The results of a conformance run: :class:`CellResult` per cell, :class:`ConformanceReport`
for the run (its capability table, JSON and Markdown). Nothing here imports torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from attn_di.conformance._case import Case, Outcome

__all__ = ["CellResult", "ConformanceReport", "capability_rows", "cells"]

_SHOWN_POSITIONS = 5


@dataclass(frozen=True)
class CellResult:
    """How one cell ended.

    Attributes:
        case: the cell.
        outcome: its :class:`Outcome`.
        declared: whether the backend declares the cell supported (its
            ``validate_configuration`` and ``supports_*`` answers).
        max_error: the largest absolute error against the float64 reference (NaN and Inf
            outputs count as ``inf``), or None when nothing was compared.
        tolerance: the tolerance at the element of the worst error-to-tolerance ratio (see
            the guide's rule), or None.
        first_wrong: up to five ``(token, head, dim)`` positions beyond tolerance, in order.
        reason: for a refusal, the backend's reason; for a failure, what went wrong; else None.
        rerun: the one-line command that re-runs this cell alone.
        seconds: how long the cell took (kit and reference included).
    """

    case: Case
    outcome: Outcome
    declared: bool
    max_error: float | None = None
    tolerance: float | None = None
    first_wrong: list[tuple[int, int, int]] = field(default_factory=list)
    reason: str | None = None
    rerun: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        """One line for people: the outcome, the id, and what went wrong."""
        text = f"{self.outcome.value.upper()} {self.case.id}"
        details = []
        if self.max_error is not None and self.tolerance is not None:
            details.append(f"max error {self.max_error:.3g} (tolerance {self.tolerance:.3g})")
        if self.first_wrong:
            details.append(
                "first wrong (token, head, dim): "
                + ", ".join(str(tuple(p)) for p in self.first_wrong[:_SHOWN_POSITIONS])
            )
        if self.reason:
            details.append(self.reason)
        return text + (": " + "; ".join(details) if details else "")

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready data (the case as its id, features and axis values)."""
        return {
            "id": self.case.id,
            "outcome": self.outcome.value,
            "declared": self.declared,
            "features": sorted(self.case.features),
            "axes": self.case.axis_values(),
            "max_error": _finite_or_str(self.max_error),
            "tolerance": self.tolerance,
            "first_wrong": [list(p) for p in self.first_wrong],
            "reason": self.reason,
            "rerun": self.rerun,
            "seconds": round(self.seconds, 4),
        }


def cells(count: int) -> str:
    """``"1 cell"``, ``"83 cells"``."""
    return f"{count} cell" if count == 1 else f"{count} cells"


@dataclass
class ConformanceReport:
    """The results of one conformance run of one backend.

    Attributes:
        target: the target as the rerun commands name it (``CPU_ATTN``,
            ``my_pkg.attention:MyBackend``).
        backend_name: the backend's ``get_name()``.
        results: one :class:`CellResult` per cell, in run order.
        seed: the run's seed.
        full: whether the full matrix ran (else the default, pairwise one).
        shard: ``"K/N"`` when the run was the K-th of N shards of the matrix, else None.
        driver: which contract drove the backend (``"attn_di"``).
        environment: where it ran: torch version, CPU, threads.
    """

    target: str
    backend_name: str
    results: list[CellResult] = field(default_factory=list)
    seed: int = 0
    full: bool = False
    shard: str | None = None
    driver: str = "attn_di"
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every cell is conformant: declared cells pass, undeclared ones are refused
        with a typed error or work."""
        return all(result.outcome.conformant for result in self.results)

    def failures(self) -> list[CellResult]:
        """The cells that fail the run (``FAIL``, ``FAIL_UNDECLARED``, ``CRASH``)."""
        return [result for result in self.results if not result.outcome.conformant]

    def counts(self) -> dict[str, int]:
        """``{outcome: cells}`` for every outcome (zeros included)."""
        counted = Counter(result.outcome for result in self.results)
        return {outcome.value: counted.get(outcome, 0) for outcome in Outcome}

    def matrix_name(self) -> str:
        """``"default matrix"``, ``"full matrix"``, with ``", shard K/N"`` for a shard."""
        name = f"{'full' if self.full else 'default'} matrix"
        return name if self.shard is None else f"{name}, shard {self.shard}"

    def seconds(self) -> float:
        """The cells' total time."""
        return sum(result.seconds for result in self.results)

    def to_json(self) -> dict[str, Any]:
        """The whole report as JSON-ready data (``attn-di conform --json``)."""
        return {
            "target": self.target,
            "backend": self.backend_name,
            "driver": self.driver,
            "seed": self.seed,
            "full": self.full,
            "shard": self.shard,
            "ok": self.ok,
            "counts": self.counts(),
            "seconds": round(self.seconds(), 3),
            "environment": dict(self.environment),
            "capabilities": [
                dict(zip(CAPABILITY_COLUMNS, row, strict=True))
                for row in capability_rows(self.results)
            ],
            "results": [result.to_json() for result in self.results],
        }

    def to_markdown(self) -> str:
        """The capability table, the counts and every failing cell, as Markdown."""
        lines = [
            f"### {self.backend_name} (`{self.target}`)",
            "",
            f"{cells(len(self.results))} ({self.matrix_name()}, seed {self.seed}): "
            + ", ".join(f"{count} {name}" for name, count in self.counts().items() if count)
            + ("" if self.ok else " — **not conformant**"),
            "",
            "| " + " | ".join(CAPABILITY_COLUMNS) + " |",
            "| " + " | ".join("---" for _ in CAPABILITY_COLUMNS) + " |",
        ]
        lines += ["| " + " | ".join(map(str, row)) + " |" for row in capability_rows(self.results)]
        failures = self.failures()
        if failures:
            lines += ["", "Failing cells:", ""]
            for result in failures:
                lines.append(f"- `{result.case.id}`: {_escape(result.line())}  ")
                lines.append(f"  rerun: `{result.rerun}`")
        return "\n".join(lines) + "\n"


CAPABILITY_COLUMNS = (
    "feature",
    "declared",
    "cells",
    "pass",
    "fail",
    "refused",
    "works, not declared",
    "fail, not declared",
    "crash",
)
"""The columns of the capability table."""


def capability_rows(results: Sequence[CellResult]) -> list[list[object]]:
    """One row per feature: whether the backend declares it (``yes``, ``no`` or ``partly``,
    over the cells that have it) and its cells' outcomes, features sorted by name."""
    by_feature: dict[str, list[CellResult]] = {}
    for result in results:
        for feature in result.case.features:
            by_feature.setdefault(feature, []).append(result)
    rows: list[list[object]] = []
    for feature in sorted(by_feature):
        cells = by_feature[feature]
        declared = {result.declared for result in cells}
        claim = "partly" if len(declared) == 2 else ("yes" if True in declared else "no")
        counted = Counter(result.outcome for result in cells)
        rows.append([feature, claim, len(cells), *(counted.get(o, 0) for o in _ORDER)])
    return rows


_ORDER = (
    Outcome.PASS,
    Outcome.FAIL,
    Outcome.REFUSED,
    Outcome.WORKS_UNDECLARED,
    Outcome.FAIL_UNDECLARED,
    Outcome.CRASH,
)


def _finite_or_str(value: float | None) -> float | str | None:
    if value is None or (value == value and abs(value) != float("inf")):
        return value
    return str(value)


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
