"""Running cells: :func:`plan_conformance` (which cells, through which driver) and
:func:`run_conformance` (run them all, the ``bad_input`` ones in a subprocess)."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from attn_di.backend import dtype_name
from attn_di.conformance._case import DTYPES, Case, Outcome
from attn_di.conformance._driver import Driver
from attn_di.conformance._report import CellResult, ConformanceReport, cells
from attn_di.exceptions import AttnDIError, InvalidInputError, closest_name

if TYPE_CHECKING:
    from attn_di.conformance._matrix import Matrix

__all__ = [
    "REFUSALS",
    "TYPED_ERRORS",
    "ConformancePlan",
    "parse_shard",
    "plan_conformance",
    "run_conformance",
]

REFUSALS: tuple[type[BaseException], ...] = (
    AttnDIError,
    NotImplementedError,
    ValueError,
    TypeError,
)
"""What counts as a typed refusal of an undeclared cell: attn_di's errors and the builtins
vLLM's impls raise for what they do not support."""
TYPED_ERRORS: tuple[type[BaseException], ...] = (*REFUSALS, LookupError)
"""What counts as a typed error for a malformed input (``IndexError`` for an index out of
range too); ``RuntimeError``, ``AssertionError`` and the rest do not."""

Progress = Callable[[CellResult, int, int], None]
"""``progress(result, done, total)``, called after each cell."""

_SHARD = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


def parse_shard(shard: object) -> tuple[int, int] | None:
    """``"K/N"`` (or ``(K, N)``) as ``(K, N)``: the K-th of N shards, 1 <= K <= N.

    Shard K of N holds the cells at positions K-1, K-1+N, K-1+2N, ... of the run's order, so
    the N shards of one seed hold every cell exactly once (N CI jobs share a long run).

    Raises:
        InvalidInputError: anything else (``"0/4"``, ``"5/4"``, ``"2-4"``), naming the value.
    """
    if shard is None:
        return None
    if isinstance(shard, tuple) and len(shard) == 2 and all(type(x) is int for x in shard):
        index, count = shard
    elif isinstance(shard, str) and (match := _SHARD.fullmatch(shard)):
        index, count = int(match[1]), int(match[2])
    else:
        raise InvalidInputError(
            "shard", f"{shard!r} is not K/N", hint="K/N with 1 <= K <= N, e.g. 2/4"
        )
    if count < 1:
        raise InvalidInputError(
            "shard", f"{shard!r}: N, the number of shards, must be >= 1", hint="e.g. 1/4"
        )
    if not 1 <= index <= count:
        shards = count
        closest = min(max(index, 1), shards)
        raise InvalidInputError(
            "shard",
            f"{shard!r}: K must be between 1 and N (shards are numbered from 1)",
            hint=f"one of 1/{shards} ... {shards}/{shards}; the closest is {closest}/{shards}",
        )
    return index, count


class ConformancePlan:
    """The cells of one run and how to run each (what :func:`run_conformance` and
    :func:`~attn_di.conformance.conformance_tests` share).

    Attributes:
        driver: the backend's driver.
        seed: the run's seed.
        full: whether the matrix is the full product.
        matrix: the cells (or the ``case_ids`` given), all shards'.
        shard: ``(K, N)`` when the plan is the K-th of N shards of ``matrix``, else None.
    """

    def __init__(
        self,
        driver: Driver,
        matrix: Matrix | Sequence[Case],
        *,
        seed: int,
        full: bool,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.driver = driver
        self.seed = seed
        self.full = full
        self.matrix = matrix
        self.shard = shard
        self._subprocess_results: dict[str, CellResult] | None = None

    @property
    def target(self) -> str:
        """The target as commands name it."""
        return self.driver.target

    def __len__(self) -> int:
        if self.shard is None:
            return len(self.matrix)
        index, count = self.shard
        return len(range(index - 1, len(self.matrix), count))

    def cases(self) -> Iterator[Case]:
        """The cells (of this shard), in order."""
        if self.shard is None:
            return iter(self.matrix)
        index, count = self.shard
        return itertools.islice(self.matrix, index - 1, None, count)

    def rerun(self, case: Case) -> str:
        """The one-line command that re-runs ``case`` alone."""
        return f"attn-di conform {self.target} --case {case.id} --seed {self.seed}"

    def run_case(self, case: Case) -> CellResult:
        """Run one cell (a ``bad_input`` one in a subprocess, with all of the plan's other
        ``bad_input`` cells the first time one is asked for)."""
        if case.check == "bad_input":
            if self._subprocess_results is None or case.id not in self._subprocess_results:
                from attn_di.conformance._isolated import run_isolated

                wanted = [c for c in self.cases() if c.check == "bad_input"]
                if case not in wanted:
                    wanted = [case]
                self._subprocess_results = {
                    **(self._subprocess_results or {}),
                    **run_isolated(self, wanted),
                }
            return self._subprocess_results[case.id]
        return run_in_process(self.driver, case, self.seed, self.rerun(case))

    def run(self, progress: Progress | None = None) -> ConformanceReport:
        """Run every cell: those in process first, then the ``bad_input`` ones in a
        subprocess (after, not meanwhile: two processes' thread pools on the same cores
        slow both down many times)."""
        from attn_di.conformance._isolated import IsolatedRun

        report = ConformanceReport(
            target=self.target,
            backend_name=self.driver.backend_name,
            seed=self.seed,
            full=self.full,
            shard=None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
            driver=self.driver.name,
            environment=self.driver.environment(),
        )
        total = len(self)
        pending: list[Case] = []
        done = 0

        def record(result: CellResult) -> None:
            nonlocal done
            report.results.append(result)
            done += 1
            if progress is not None:
                progress(result, done, total)

        for case in self.cases():
            if case.check == "bad_input":
                pending.append(case)
            else:
                record(run_in_process(self.driver, case, self.seed, self.rerun(case)))
        if pending:
            isolated = IsolatedRun(self, pending)
            try:
                found = isolated.results()
            finally:
                isolated.close()
            for case in pending:
                record(found[case.id])
        return report


def plan_conformance(
    target: object,
    *,
    full: bool = False,
    seed: int = 0,
    dtypes: Sequence[str] | None = None,
    case_ids: Sequence[str] | None = None,
    shard: tuple[int, int] | str | None = None,
) -> ConformancePlan:
    """Which cells a run has and how it runs them, without running any.

    Args: as :func:`run_conformance`.

    Raises:
        InvalidInputError: an unknown dtype, a malformed case id or shard, a ``seed`` that
            is no int, a ``full`` that is no bool, or filters that leave no cell.
        UnknownBackendError, BackendImportError, InvalidBackendTypeError: a target that does
            not name a backend class (as :func:`run_conformance`).
    """
    from attn_di.conformance._matrix import build_matrix
    from attn_di.conformance._target import resolve_driver

    if not isinstance(full, bool):
        raise InvalidInputError("full", f"must be True or False, got {full!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidInputError(
            "seed", f"must be an int, got {seed!r} ({type(seed).__name__})", hint="e.g. seed=0"
        )
    wanted = None if dtypes is None else [_dtype(d) for d in _names("dtypes", dtypes)]
    cases = None
    if case_ids is not None:
        cases = []
        for case_id in _names("case_ids", case_ids):
            if not isinstance(case_id, str):
                raise InvalidInputError(
                    "case_ids", f"{case_id!r} is not a case id (a str)", hint="see Case.id"
                )
            cases.append(Case.from_id(case_id))
    part = parse_shard(shard)
    driver = resolve_driver(target)
    plan: ConformancePlan
    if cases is not None:
        if wanted is not None:
            cases = [case for case in cases if case.dtype in wanted]
        plan = ConformancePlan(driver, cases, seed=seed, full=full, shard=part)
    elif wanted == []:  # no dtype: no cell (and no axis to build pairs on)
        plan = ConformancePlan(driver, [], seed=seed, full=full, shard=part)
    else:
        matrix = build_matrix(driver.capabilities(), seed=seed, full=full, dtypes=wanted)
        plan = ConformancePlan(driver, matrix, seed=seed, full=full, shard=part)
    if not len(plan):
        raise _no_cells(plan, wanted, case_ids)
    return plan


def _names(argument: str, names: object) -> list[object]:
    """``names`` as a list; a lone string (which would be read letter by letter) refused."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidInputError(
            argument,
            f"must be a list, got {names!r} ({type(names).__name__})",
            hint=f"{argument}=[{names!r}]",
        )
    return list(names)


def _no_cells(
    plan: ConformancePlan, dtypes: Sequence[str] | None, case_ids: Sequence[str] | None
) -> InvalidInputError:
    """The error for a run that selects no cell (it would pass, having checked nothing)."""
    why = []
    if case_ids is not None:
        why.append(f"{len(case_ids)} case id(s)")
    if dtypes is not None:
        why.append(f"dtypes {', '.join(dtypes) or '(none)'}")
    if plan.shard is not None:
        index, count = plan.shard
        why.append(f"shard {index}/{count} of {cells(len(plan.matrix))}")
    return InvalidInputError(
        "cells",
        f"the run selects no cell of {plan.driver.backend_name} ({'; '.join(why)}), so it "
        "would check nothing",
        hint="widen the filters: fewer shards than cells, dtypes the cells have "
        f"({', '.join(DTYPES)})",
    )


def run_conformance(
    target: object,
    *,
    full: bool = False,
    seed: int = 0,
    dtypes: Sequence[str] | None = None,
    case_ids: Sequence[str] | None = None,
    shard: tuple[int, int] | str | None = None,
    progress: Progress | None = None,
) -> ConformanceReport:
    """Run the conformance matrix on a backend.

    Args:
        target: a backend class, an ``AttentionBackendEnum`` member, a member name
            (``"CPU_ATTN"``, runtime members too) or a class path (``"pkg.mod:Cls"``).
        full: the full product of the axes instead of the default pairwise cells (long).
        seed: picks the pairwise cells and every cell's random data.
        dtypes: only cells of these dtypes (``"bfloat16"``, ``"bf16"``, ``torch.float16``).
        case_ids: only these cells (ids as :attr:`Case.id`), whatever the matrix.
        shard: ``"K/N"`` or ``(K, N)``: only the K-th of N shards of the cells
            (:func:`parse_shard`), so that N jobs share one long run (``full=True``).
        progress: called after each cell with ``(result, done, total)``.

    Returns:
        The :class:`ConformanceReport`; ``report.ok`` says whether the backend conforms.

    Raises:
        UnknownBackendError, BackendImportError, InvalidBackendTypeError: a target that does
            not name a backend class.
        InvalidInputError: an unknown dtype, a malformed case id or shard.
    """
    plan = plan_conformance(
        target, full=full, seed=seed, dtypes=dtypes, case_ids=case_ids, shard=shard
    )
    return plan.run(progress)


def _dtype(dtype: object) -> str:
    name = dtype_name(dtype)
    if name not in DTYPES:
        close = closest_name(str(dtype), [*DTYPES, *DTYPES.values()])
        raise InvalidInputError(
            "dtypes",
            f"{dtype!r} is not one of the matrix's dtypes: {', '.join(DTYPES)}",
            hint=(f"did you mean {close!r}? " if close else "")
            + f"one of {', '.join(DTYPES)} (or {', '.join(DTYPES.values())})",
        )
    return name


# -- one cell ----------------------------------------------------------------------------


def run_in_process(driver: Driver, case: Case, seed: int, rerun: str) -> CellResult:
    """Run one cell here (any check but ``bad_input``, which :func:`run_bad_input` runs)."""
    from attn_di.conformance import _checks

    started = time.perf_counter()
    reasons = driver.reasons(case)
    declared = not reasons
    if case.check == "threads" and not declared:
        # A race cannot be refused with an error: concurrency outside the contract is not run.
        return CellResult(
            case=case,
            outcome=Outcome.REFUSED,
            declared=False,
            reason=f"{driver.backend_name}: {'; '.join(reasons)} (not run)",
            rerun=rerun,
            seconds=time.perf_counter() - started,
        )
    try:
        if case.check == "bad_input":
            verdict = _checks.bad_input(driver, case, seed)
        else:
            verdict = _checks.CHECKS[case.check](driver, case, seed, driver.capabilities())
    except _checks.Raised as raised:
        verdict = _checks.Verdict.from_raised(raised, declared, reasons, case)
    outcome = verdict.outcome(declared)
    reason = verdict.reason
    if outcome is Outcome.REFUSED and reasons:
        reason = f"{driver.backend_name}: {'; '.join(reasons)}" + (f" ({reason})" if reason else "")
    return CellResult(
        case=case,
        outcome=outcome,
        declared=declared,
        max_error=verdict.max_error,
        tolerance=verdict.tolerance,
        first_wrong=list(verdict.first_wrong),
        reason=reason,
        rerun=rerun,
        seconds=time.perf_counter() - started,
    )


def result_from_json(case: Case, data: dict[str, Any]) -> CellResult:
    """A :class:`CellResult` from :meth:`CellResult.to_json`'s data."""
    max_error = data.get("max_error")
    return CellResult(
        case=case,
        outcome=Outcome(data["outcome"]),
        declared=bool(data["declared"]),
        max_error=None if max_error is None else float(max_error),
        tolerance=data.get("tolerance"),
        first_wrong=[(int(t), int(h), int(d)) for t, h, d in data.get("first_wrong", [])],
        reason=data.get("reason"),
        rerun=data.get("rerun", ""),
        seconds=float(data.get("seconds", 0.0)),
    )
