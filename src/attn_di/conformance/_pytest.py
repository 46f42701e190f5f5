"""The kit in pytest: :func:`conformance_tests` (one test per cell, in a test module) and the
items of ``pytest --attn-di-conform=TARGET`` (attn_di's pytest plugin)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from attn_di.conformance._case import Case, Outcome
from attn_di.conformance._report import CellResult

if TYPE_CHECKING:
    from attn_di.conformance._runner import ConformancePlan

__all__ = ["check_cell", "conformance_tests"]


def conformance_tests(
    target: object,
    *,
    full: bool = False,
    seed: int = 0,
    dtypes: Sequence[str] | None = None,
    case_ids: Sequence[str] | None = None,
    shard: tuple[int, int] | str | None = None,
) -> Callable[..., None]:
    """A pytest test function with one test per cell of the backend's matrix.

    Assign it to a ``test_`` name in a test module::

        from attn_di.conformance import conformance_tests
        from my_pkg.attention import MyBackend

        test_my_backend = conformance_tests(MyBackend)

    Test ids are the cells' ids (``test_my_backend[bf16-gqa4-decode-len150-window50-block16]``),
    so ``-k window`` runs the sliding-window cells. A cell the backend does not declare and
    refuses is a skip naming the backend's reason; a failing cell fails with its report line
    and the command that re-runs it alone; "works, not declared" passes.

    Args: as :func:`~attn_di.conformance.run_conformance` (the matrix is built now, at
        collection: the target is resolved and its declarations read).

    Returns:
        The test function (``@pytest.mark.parametrize``-d over the cells).
    """
    import pytest

    from attn_di.conformance._runner import plan_conformance

    plan = plan_conformance(
        target, full=full, seed=seed, dtypes=dtypes, case_ids=case_ids, shard=shard
    )
    cases = list(plan.cases())

    @pytest.mark.parametrize("case", cases, ids=[case.id for case in cases])
    def test_conformance(case: Case) -> None:
        check_cell(plan, case)

    test_conformance.__doc__ = (
        f"One cell of the conformance matrix of {plan.driver.backend_name} ({plan.target}): "
        "correct if declared, refused (a skip) or correct if not."
    )
    return test_conformance


def check_cell(plan: ConformancePlan, case: Case) -> CellResult:
    """Run one cell for pytest: skip a refusal, fail a failure (with its rerun command)."""
    import pytest

    result = plan.run_case(case)
    if result.outcome is Outcome.REFUSED:
        pytest.skip(result.reason or f"{plan.driver.backend_name} refuses it")
    if not result.outcome.conformant:
        pytest.fail(f"{result.line()}\nrerun: {result.rerun}", pytrace=False)
    return result


def collect_items(
    session: Any,
    targets: Sequence[str],
    *,
    full: bool,
    seed: int,
    shard: tuple[int, int] | str | None = None,
) -> list[Any]:
    """The items of ``--attn-di-conform`` targets: one collector per target, one item per cell
    (of the shard, when one is given)."""
    from attn_di.conformance._runner import plan_conformance

    items: list[Any] = []
    for target in targets:
        plan = plan_conformance(target, full=full, seed=seed, shard=shard)
        name = f"attn-di-conform[{plan.target}]"
        collector = _collector_cls().from_parent(session, name=name, nodeid=name)
        for case in plan.cases():
            items.append(_item_cls().from_parent(collector, name=case.id, plan=plan, case=case))
    return items


_CLASSES: dict[str, Any] = {}


def _collector_cls() -> Any:
    """pytest's node classes are made on first use (pytest is imported only then)."""
    if "collector" not in _CLASSES:
        import pytest

        class ConformanceTarget(pytest.Collector):
            """The cells of one ``--attn-di-conform`` target."""

            def collect(self) -> list[Any]:  # pragma: no cover - items are made directly
                return []

        class ConformanceItem(pytest.Item):
            """One cell of the conformance matrix as a test."""

            def __init__(self, *, plan: ConformancePlan, case: Case, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.plan = plan
                self.case = case
                self.keywords.update(dict.fromkeys(case.features, True))

            def runtest(self) -> None:
                check_cell(self.plan, self.case)

            def reportinfo(self) -> tuple[str, int | None, str]:
                return (f"attn-di conform {self.plan.target}", None, self.case.id)

        _CLASSES["collector"] = ConformanceTarget
        _CLASSES["item"] = ConformanceItem
    return _CLASSES["collector"]


def _item_cls() -> Any:
    _collector_cls()
    return _CLASSES["item"]
