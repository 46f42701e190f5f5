"""No false alarm: attn_di's own backends conform on everything they declare.

Which runs: CPU_ATTN on its compiled kernels and on its pure-torch path, and TORCH_SDPA, the
whole default matrix each; FLEX_ATTENTION (eager flex attention on CPU is slow: about a
second a cell) the default matrix's bfloat16 cells. A spy on each backend's own code checks
that the path under test is the one that ran. Each report's capability table must be the one
checked in under docs/reference/capabilities/ (scripts/capability_tables.py writes them): these
runs are the tables' freshness test.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from attn_di.backends import _cpu_kernel
from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from attn_di.backends.flex_attention import FlexAttentionBackend, FlexAttentionImpl
from attn_di.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from attn_di.conformance import ConformanceReport, Outcome, plan_conformance, run_conformance


def _spy(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    calls: list[int] = []
    original: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@cache
def _capability_tables() -> ModuleType:
    """scripts/capability_tables.py, imported by path."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "capability_tables.py"
    spec = importlib.util.spec_from_file_location("capability_tables", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _table(slug: str, title: str) -> Any:
    tables = _capability_tables()
    (table,) = [t for p in tables.PAGE_LIST if p.slug == slug for t in p.tables if t.title == title]
    return table


def _assert_page_is_fresh(report: ConformanceReport, slug: str, title: str) -> None:
    """The report's table is the one on docs/reference/capabilities/<slug>.md under ``title``."""
    tables = _capability_tables()
    expected = tables.table_in_page(report.to_markdown()).strip()
    assert tables.page_table(slug, title) == expected, (
        f"docs/reference/capabilities/{slug}.md ({title}) is stale: run "
        f"`python scripts/capability_tables.py {slug}` and commit the page. Fresh table:\n"
        f"{expected}"
    )


def _not_passing(report: ConformanceReport) -> dict[str, str]:
    return {r.case.id: f"{r.outcome.value}: {r.line()}" for r in report.results
            if r.outcome is not Outcome.PASS}  # fmt: skip


def test_cpu_attn_compiled_kernels_conform(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU_ATTN declares every feature of the matrix: every default cell passes, through
    its compiled kernels."""
    status = _cpu_kernel.kernel_status()
    if not status.active:
        pytest.skip(f"CPU_ATTN's kernel: {status.describe()}")
    kernel_calls = _spy(monkeypatch, CPUAttentionImpl, "_run_kernel")
    report = run_conformance(CPUAttentionBackend)
    assert _not_passing(report) == {}
    assert len(report.results) > 80
    assert len(kernel_calls) > len(report.results)
    assert report.environment["cpu_attn"].startswith("compiled decode and prefill kernels")
    _assert_page_is_fresh(report, "cpu-attn", "Compiled kernels")


def test_cpu_attn_pure_torch_path_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the pure-torch path (the bad-input subprocess runs it too, switched off
    by ATTN_DI_CPU_KERNEL=0); the kernel never runs."""
    kernel_calls = _spy(monkeypatch, CPUAttentionImpl, "_run_kernel")
    grouped_calls = _spy(monkeypatch, CPUAttentionImpl, "_attend")
    with _cpu_kernel.pure_torch():
        report = run_conformance(CPUAttentionBackend)
    assert _not_passing(report) == {}
    assert kernel_calls == []
    assert grouped_calls
    assert report.environment["cpu_attn"] == "pure torch"
    _assert_page_is_fresh(report, "cpu-attn", "Pure-torch path")


def test_torch_sdpa_conforms_and_refuses_the_soft_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_SDPA passes every declared cell; its one undeclared feature, the soft cap, is
    refused with its typed error."""
    calls = _spy(monkeypatch, TorchSDPAImpl, "_attend")
    report = run_conformance(TorchSDPABackend)
    assert report.ok
    refused = {case_id for case_id, line in _not_passing(report).items()}
    assert len(refused) == 1
    (result,) = [r for r in report.results if r.case.id in refused]
    assert result.outcome is Outcome.REFUSED
    assert result.case.softcap is not None
    assert result.reason is not None
    assert "UnsupportedFeatureError: TORCH_SDPA does not support logits_soft_cap" in result.reason
    assert calls
    _assert_page_is_fresh(report, "torch-sdpa", "Default matrix")


def test_flex_attention_conforms_on_the_bf16_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEX_ATTENTION: the default matrix's bfloat16 cells (a reduced subset: eager flex
    attention is slow on CPU) all pass."""
    calls = _spy(monkeypatch, FlexAttentionImpl, "_attend")
    cells = [c.id for c in plan_conformance(FlexAttentionBackend).cases() if c.dtype == "bfloat16"]
    assert len(cells) > 20
    assert cells == _capability_tables().case_ids(_table("flex-attention", _FLEX_TITLE))
    report = run_conformance(FlexAttentionBackend, case_ids=cells)
    assert _not_passing(report) == {}
    assert calls
    _assert_page_is_fresh(report, "flex-attention", _FLEX_TITLE)


_FLEX_TITLE = "Default matrix, bfloat16 cells"
