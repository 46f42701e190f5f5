"""The kit on vLLM's own CPU backend, through vLLM's contract: the published table
(docs/guides/conformance-vllm-cpu.md) is what the default matrix measures now, and the cells
where vLLM and the kit disagree end as the page explains.

One default run (seed 0) for the whole module, about two minutes on two cores; vLLM's op is
spied on to show that its kernel computed the cells.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run in .venv-vllm)")

from attn_di.conformance import ConformanceReport, Outcome
from attn_di.conformance._report import CellResult

REPO = Path(__file__).resolve().parents[2]
NAN_TAIL_CELLS = ("bf16-gqa2-decode-len40-block64", "fp32-gqa2-mixed-len40-block64")


def _script() -> ModuleType:
    path = REPO / "scripts" / "vllm_conformance_table.py"
    spec = importlib.util.spec_from_file_location("vllm_conformance_table", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", name="table")
def _table() -> ModuleType:
    return _script()


@pytest.fixture(scope="module", name="measured")
def _measured(table: ModuleType) -> tuple[ConformanceReport, int]:
    """The default run, and how many times vLLM's attention op ran in this process."""
    from vllm import _custom_ops

    calls = 0
    original = _custom_ops.cpu_attention_with_kv_cache

    def spy(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_custom_ops, "cpu_attention_with_kv_cache", spy)
        report = table.measure()
    return report, calls


@pytest.fixture(name="report")
def _report(measured: tuple[ConformanceReport, int]) -> ConformanceReport:
    return measured[0]


def _by_id(report: ConformanceReport) -> dict[str, CellResult]:
    return {result.case.id: result for result in report.results}


def test_the_published_table_is_what_the_matrix_measures_now(
    table: ModuleType, report: ConformanceReport
) -> None:
    """The page's counts, capability table and failing cells' outcomes equal a fresh run's
    (regenerate with scripts/vllm_conformance_table.py when they change)."""
    published = table.block_of((REPO / "docs" / "guides" / "conformance-vllm-cpu.md").read_text())
    recorded, here = table.machine_of(published), table.machine()
    if (recorded["avx512"], recorded["amx"]) != (here["avx512"], here["amx"]):
        pytest.skip(f"the table was measured with {recorded}; this machine has {here}")
    assert recorded["vllm"] == here["vllm"], "regenerate the table for this vLLM"
    fresh = table.render(report, here, table.cpu_name())
    assert table.digest(fresh) == table.digest(published)
    assert len(table.digest(published)) > 30


def test_vllm_s_kernel_computed_the_cells(measured: tuple[ConformanceReport, int]) -> None:
    """vLLM's op ran for the in-process cells (the bad_input ones run in a subprocess)."""
    report, calls = measured
    in_process = [r for r in report.results if r.case.check != "bad_input" and r.case.uses_cache]
    assert calls >= len(in_process) > 50


def test_every_declared_cell_in_vllm_s_cache_convention_passes(report: ConformanceReport) -> None:
    """Every declared cell but the malformed inputs passes: windows (of one position, of the
    whole sequence, over 8k tokens), soft cap, ALiBi, the encoder kinds, the checks."""
    declared = [r for r in report.results if r.declared and r.case.check != "bad_input"]
    assert {r.case.id: r.outcome for r in declared if r.outcome is not Outcome.PASS} == {}
    assert len(declared) > 60
    by_id = _by_id(report)
    for cell in (
        "bf16-gqa2-mixed-len40-window1-block64-finitetails",
        "bf16-gqa2-mixed-len40-window40-block64-finitetails",
        "bf16-gqa2-decode-len8192-window1000-block64-finitetails",
        "fp32-gqa2-mixed-len40-block64-finitetails",
    ):
        assert by_id[cell].outcome is Outcome.PASS


def test_nan_in_the_tail_of_a_used_block_poisons_vllm_s_output(report: ConformanceReport) -> None:
    """The kit's NaN tails are outside vLLM's contract (not declared) and vLLM's kernel,
    weighting them by zero, answers NaN: fail, not declared; the same batch with finite
    tails passes."""
    from attn_di.integrations.vllm._conformance import NAN_TAILS_REASON

    by_id = _by_id(report)
    for cell in NAN_TAIL_CELLS:
        result = by_id[cell]
        assert result.outcome is Outcome.FAIL_UNDECLARED
        assert result.max_error == float("inf")
        assert result.reason == "non-finite output"
    twin = by_id["fp32-gqa2-mixed-len40-block64-finitetails"]
    assert twin.outcome is Outcome.PASS
    from attn_di.conformance import plan_conformance

    driver = plan_conformance(report.target, case_ids=[NAN_TAIL_CELLS[0]]).driver
    assert NAN_TAILS_REASON in driver.reasons(by_id[NAN_TAIL_CELLS[0]].case)
    assert driver.reasons(twin.case) == []


def test_undeclared_values_are_refused_untyped_or_work(report: ConformanceReport) -> None:
    """Head size 7 and block size 1 raise RuntimeError (vLLM refuses them at selection, not
    in the call); sinks, not declared, work."""
    by_id = _by_id(report)
    head = by_id["bf16-h7-gqa2-decode-len40-block64-finitetails"]
    block = by_id["bf16-gqa2-decode-len40-block1-finitetails"]
    for result, words in ((head, "Unsupported CPU attention configuration"), (block, "block_size")):
        assert result.outcome is Outcome.FAIL_UNDECLARED
        assert result.reason is not None
        assert "RuntimeError" in result.reason
        assert words in result.reason
    assert by_id["bf16-gqa2-decode-len40-sinks-block64-finitetails"].outcome is (
        Outcome.WORKS_UNDECLARED
    )


def test_malformed_inputs_are_not_validated(report: ConformanceReport) -> None:
    """vLLM's impl trusts its inputs: one crashes, one raises RuntimeError, six pass
    unnoticed."""
    prefix = "fp32-gqa2-mixed-len60-block64-finitetails-bad_"
    by_id = _by_id(report)
    assert by_id[prefix + "query_shape"].outcome is Outcome.CRASH
    key_dtype = by_id[prefix + "key_dtype"]
    assert key_dtype.outcome is Outcome.FAIL
    assert key_dtype.reason is not None
    assert "RuntimeError" in key_dtype.reason
    for what in (
        "kv_heads",
        "cache_shape",
        "slot_range",
        "block_range",
        "seq_lens_count",
        "output_shape",
    ):
        result = by_id[prefix + what]
        assert result.outcome is Outcome.FAIL
        assert result.reason == f"accepted a malformed input ({what}) without an error"


def test_two_threads_at_once_are_refused_as_outside_vllm_s_contract(
    report: ConformanceReport,
) -> None:
    """vLLM runs one forward at a time per process and its CPU op shares one scratchpad per
    process: the threads cells are refused, not run (a race gives a different table each run)."""
    threads = [r for r in report.results if r.case.check == "threads"]
    assert len(threads) == 2
    for result in threads:
        assert result.outcome is Outcome.REFUSED
        assert not result.declared
        assert result.reason is not None
        assert "outside vLLM's contract" in result.reason
        assert "ScratchPadManager" in result.reason
        assert result.reason.endswith("(not run)")
