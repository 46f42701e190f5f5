"""The kit in a backend author's pytest session: ``conformance_tests`` in a test module and
``pytest --attn-di-conform=TARGET``, run through pytester."""

from __future__ import annotations

import pytest

from attn_di.backends import _cpu_kernel

# pytester gives its subprocesses a HOME of their own: point them at this session's kernel
# builds, or CPU_ATTN's kernel is compiled again (minutes).
KERNEL_CACHE = str(_cpu_kernel.cache_root())

MODULE = """
from attn_di.conformance import conformance_tests
from attn_di.backends.torch_sdpa import TorchSDPABackend
from tests.conformance.kit_backends import Bf16AccumulatingBackend

test_sdpa = conformance_tests(
    TorchSDPABackend,
    case_ids=["fp32-gqa2-decode-len40-block16", "bf16-gqa2-decode-len40-softcap2-block16"],
)
test_accumulating = conformance_tests(
    Bf16AccumulatingBackend, case_ids=["bf16-gqa2-decode-len8192-block16"]
)
"""


@pytest.fixture(autouse=True)
def _kernel_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_cpu_kernel.ENV_CACHE, KERNEL_CACHE)


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                                         "-rsf", *args)  # fmt: skip


def test_one_test_per_cell_with_skips_and_failures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids are the cells' ids; a refusal is a skip naming the backend's reason; a failure
    shows the cell's line and its rerun command."""
    monkeypatch.setenv("PYTHONPATH", str(pytester.path.parent) + ":" + _paths())
    pytester.makepyfile(test_backend=MODULE)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=1, skipped=1, failed=1)
    result.stdout.fnmatch_lines([
        "*test_backend.py::test_sdpa[[]fp32-gqa2-decode-len40-block16[]] PASSED*",
        "*test_backend.py::test_sdpa[[]bf16-gqa2-decode-len40-softcap2-block16[]] SKIPPED*",
        "*FAIL bf16-gqa2-decode-len8192-block16: max error * (tolerance *); first wrong*",
        "rerun: attn-di conform tests.conformance.kit_backends:Bf16AccumulatingBackend "
        "--case bf16-gqa2-decode-len8192-block16 --seed 0",
        "SKIPPED * TORCH_SDPA: logits soft cap not supported*",
    ])  # fmt: skip


def test_the_command_line_option_collects_the_cells(pytester: pytest.Pytester) -> None:
    """--attn-di-conform=CPU_ATTN adds the default matrix's cells as items, marked
    attn_di_conform; -k selects among them."""
    pytester.makepyfile(test_other="def test_other():\n    pass\n")
    listed = _run(pytester, "--attn-di-conform=CPU_ATTN", "--co", "-q")
    lines = [line for line in listed.stdout.lines if line.startswith("attn-di-conform[")]
    assert len(lines) > 60
    assert "attn-di-conform[CPU_ATTN]::fp32-gqa2-mixed-len60-block16-threads" in lines
    assert any(line.startswith("test_other.py::test_other") for line in listed.stdout.lines)
    ran = _run(pytester, "--attn-di-conform=CPU_ATTN", "-m", "attn_di_conform", "-k", "len1-",
               "-v")  # fmt: skip
    ran.assert_outcomes(passed=len([line for line in lines if "len1-" in line]))
    ran.stdout.fnmatch_lines(["*attn-di-conform[[]CPU_ATTN[]]::*-prefill-len1-* PASSED*"])


def test_an_unknown_target_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """--attn-di-conform with a misspelled member: pytest stops with attn_di's message."""
    result = _run(pytester, "--attn-di-conform=CPU_ATN")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attn-di-conform: Unknown attention backend: 'CPU_ATN'*"])


def _paths() -> str:
    import sys

    return ":".join(p for p in sys.path if p)
