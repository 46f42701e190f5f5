"""Every outcome, each from a small backend made to end in it; the checks of the cache write,
of determinism and of a crash in the subprocess."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pytest_mock import MockerFixture

from attn_di.backend import AttentionImpl
from attn_di.conformance import ConformanceReport, Outcome, run_conformance
from tests.conformance import kit_backends as kit

DECODE = "bf16-gqa2-decode-len40-block16"
ODD_HEAD = "bf16-h7-gqa2-decode-len40-block16"
ALIBI = "bf16-gqa2-decode-len40-alibi-block16"
SOFTCAP = "bf16-gqa2-decode-len40-softcap2-block16"


def _outcomes(report: ConformanceReport) -> dict[str, Outcome]:
    return {result.case.id: result.outcome for result in report.results}


def test_a_correct_backend_passes_and_refuses_what_it_does_not_declare() -> None:
    """Declared cells pass; the undeclared soft cap is refused with the backend's reason."""
    report = run_conformance(kit.ReferenceBackend, case_ids=[DECODE, ALIBI, SOFTCAP])
    assert _outcomes(report) == {
        DECODE: Outcome.PASS,
        ALIBI: Outcome.PASS,
        SOFTCAP: Outcome.REFUSED,
    }
    refused = report.results[2]
    assert not refused.declared
    assert refused.reason is not None
    assert refused.reason.startswith("REFERENCE_TEST: logits soft cap not supported")
    assert "UnsupportedFeatureError" in refused.reason
    assert report.ok


def test_works_undeclared_and_fails_undeclared() -> None:
    """Head size 7 not declared: computed right it works (conformant), computed wrong it
    fails (not conformant)."""
    works = run_conformance(kit.Head64Backend, case_ids=[ODD_HEAD])
    assert _outcomes(works) == {ODD_HEAD: Outcome.WORKS_UNDECLARED}
    assert works.ok
    wrong = run_conformance(kit.Head64GarbageBackend, case_ids=[ODD_HEAD])
    assert _outcomes(wrong) == {ODD_HEAD: Outcome.FAIL_UNDECLARED}
    assert not wrong.ok
    assert wrong.failures()[0].first_wrong[0] == (0, 0, 0)


def test_an_untyped_refusal_is_a_failure() -> None:
    """An undeclared feature refused with a RuntimeError is not a typed refusal."""
    report = run_conformance(kit.UntypedRefusalBackend, case_ids=[ALIBI])
    (result,) = report.results
    assert result.outcome is Outcome.FAIL_UNDECLARED
    assert result.reason == (
        "not declared, and constructing the impl raised RuntimeError: no ALiBi here: "
        "not a typed refusal"
    )


def test_a_cache_that_is_not_written_fails() -> None:
    """Right outputs, but the new keys never reach the cache: the cache check names it."""
    report = run_conformance(kit.NoCacheWriteBackend, case_ids=[DECODE])
    (result,) = report.results
    assert result.outcome is Outcome.FAIL
    assert result.max_error is not None
    assert result.tolerance is not None
    assert result.max_error <= result.tolerance
    assert result.reason is not None
    assert result.reason.startswith("KV-cache write: ")
    assert "a slot of the batch's new tokens" in result.reason


def test_a_crash_in_the_subprocess_is_a_crash_and_the_rest_still_run() -> None:
    """os.abort() on a bad slot: that cell is a crash; the next cells run in a new process."""
    report = run_conformance(
        kit.AbortingBackend,
        case_ids=[
            "fp32-gqa2-mixed-len60-block16-bad_slot_range",
            "fp32-gqa2-mixed-len60-block16-bad_block_range",
        ],
    )
    crash, refused = report.results
    assert crash.outcome is Outcome.CRASH
    assert crash.reason is not None
    assert crash.reason.startswith("the subprocess died of SIGABRT")
    assert refused.outcome is Outcome.PASS
    assert refused.reason is not None
    assert refused.reason.startswith("refused: InvalidInputError: block_table: ")


def test_an_accepted_malformed_input_fails() -> None:
    """A backend that does not check the query's shape answers a malformed call: a failure."""

    class Unchecked(kit.ReferenceBackend):
        @staticmethod
        def get_impl_cls() -> type[AttentionImpl]:
            return UncheckedImpl

    class UncheckedImpl(kit.ReferenceImpl):
        backend: ClassVar[type[kit.AttentionBackend]] = Unchecked

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):  # type: ignore[no-untyped-def]
            return query.reshape(query.shape[0], -1)

    # A class made inside a function cannot be imported by a subprocess: the cell runs here.
    report = run_conformance(Unchecked, case_ids=["fp32-gqa2-mixed-len60-block16-bad_query_shape"])
    (result,) = report.results
    assert result.outcome is Outcome.FAIL
    assert result.reason == "accepted a malformed input (query_shape) without an error"


@pytest.mark.parametrize("check", ["determinism", "invariance", "threads"])
def test_the_property_checks_pass_on_a_correct_backend(check: str) -> None:
    """Determinism, batch invariance and two threads at once, on the reference backend."""
    case_id = f"bf16-gqa2-mixed-len60-block16-{check}"
    report = run_conformance(kit.ReferenceBackend, case_ids=[case_id])
    assert _outcomes(report) == {case_id: Outcome.PASS}


def test_the_report_renders_as_json_and_markdown() -> None:
    """JSON: counts, capability rows, each cell; Markdown: the table and each failing cell's
    rerun command."""
    report = run_conformance(kit.Head64GarbageBackend, case_ids=[DECODE, ODD_HEAD])
    data = report.to_json()
    assert data["ok"] is False
    assert data["counts"]["fail_undeclared"] == 1
    assert data["counts"]["pass"] == 1
    assert {row["feature"] for row in data["capabilities"]} >= {"bf16", "decode", "odd_head_size"}
    assert data["results"][1]["rerun"] == (
        "attn-di conform tests.conformance.kit_backends:Head64GarbageBackend "
        f"--case {ODD_HEAD} --seed 0"
    )
    markdown = report.to_markdown()
    assert "| feature | declared | cells |" in markdown
    assert f"rerun: `{data['results'][1]['rerun']}`" in markdown
    assert "| odd_head_size | no | 1 | 0 | 0 | 0 | 0 | 1 | 0 |" in markdown


def test_threads_outside_the_contract_are_refused_without_running(mocker: MockerFixture) -> None:
    """A driver that does not declare concurrent calls (vLLM's, say) gets its threads cell
    refused with its reason and never run: a race cannot be refused with an error, and one
    that is run gives a different answer each time."""
    from attn_di.conformance._driver import InterfaceDriver

    reason = "one forward at a time per process"
    original = InterfaceDriver.reasons
    mocker.patch.object(
        InterfaceDriver,
        "reasons",
        lambda self, case: [*original(self, case), *([reason] if case.check == "threads" else [])],
    )
    make_impl = mocker.spy(InterfaceDriver, "make_impl")
    threads, alone = "bf16-gqa2-mixed-len60-block16-threads", "bf16-gqa2-mixed-len60-block16"
    report = run_conformance(kit.ReferenceBackend, case_ids=[threads, alone])
    assert _outcomes(report) == {threads: Outcome.REFUSED, alone: Outcome.PASS}
    assert report.results[0].reason == f"REFERENCE_TEST: {reason} (not run)"
    assert not report.results[0].declared
    assert make_impl.call_count == 1  # the numerics cell only
    assert report.ok
