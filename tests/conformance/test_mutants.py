"""The conformance kit catches what it must: the mutants of tests/conformance/mutants.py.

First, each mutant is really broken where it says and right elsewhere, checked against
tests/backends/reference.py on hand-made batches (errors against the float64 reference, on
caches dirty (NaN) outside the written slots; "right" is within the float32 budget of
tests/backends/test_correctness.py, 1e-4; "wrong" an error of at least 1e-2, or NaN).
Then the kit's default run catches every one with the right feature named, while the
unmutated backends' default runs are ok; and ``attn-di conform``, ``conformance_tests`` and
``pytest --attn-di-conform`` give the verdicts as exit codes and test outcomes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_di.backend import AttentionBackend, AttentionMetadataBuilder
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend
from attn_di.conformance import ConformanceReport, Outcome, plan_conformance, run_conformance
from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError
from attn_di.reference import reference_attention as paged_reference
from tests.backends.reference import Batch, Options, make_batch, reference_attention
from tests.conformance import mutants
from tests.conformance.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
RIGHT = 1e-4  # float32's budget
WRONG = 1e-2


def _forward(backend: type[AttentionBackend], opts: Options, batch: Batch) -> torch.Tensor:
    impl = backend.get_impl_cls()(**opts.impl_kwargs())
    return impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)


def _error(
    backend: type[AttentionBackend],
    opts: Options,
    query_lens: list[int],
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    block_size: int = 4,
    fill: str = "nan",
) -> float:
    """Largest absolute error against the float64 reference (NaN counts as infinite)."""
    batch = make_batch(opts, query_lens, seq_lens, block_size, dtype, fill=fill)
    error = (_forward(backend, opts, batch).double() - reference_attention(opts, batch)).abs()
    return float(error.nan_to_num(torch.inf).max())


GQA = Options(num_heads=8, num_kv_heads=2, head_size=32)
MIXED = ([5, 1, 3], [5, 9, 12])  # a prefill, a decode, a chunk over a cached prefix
ALIBI = [2.0 ** -(h + 1) for h in range(8)]


@dataclasses.dataclass
class Check:
    """A batch on which a mutant must be wrong, and one on which it must be right."""

    wrong: dict[str, Any]
    right: dict[str, Any]


def _case(
    opts: Options = GQA,
    query_lens: list[int] | None = None,
    seq_lens: list[int] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Keyword arguments of :func:`_error`: GQA on MIXED unless said."""
    lens = {"query_lens": query_lens or MIXED[0], "seq_lens": seq_lens or MIXED[1]}
    return {"opts": opts, **lens, **kw}


# The mutants whose bug shows on one batch against the reference.
NUMERIC_CHECKS: dict[type[Mutant], Check] = {
    mutants.WindowOffByOne: Check(
        _case(dataclasses.replace(GQA, sliding_window=3)),
        _case(dataclasses.replace(GQA, sliding_window=64)),  # wider than every sequence
    ),
    mutants.SoftCapIgnored: Check(_case(dataclasses.replace(GQA, logits_soft_cap=2.0)), _case()),
    mutants.AlibiIgnored: Check(_case(dataclasses.replace(GQA, alibi_slopes=ALIBI)), _case()),
    mutants.SinksIgnored: Check(
        _case(dataclasses.replace(GQA, sinks=torch.linspace(-1.0, 2.0, 8))), _case()
    ),
    mutants.DeclaresSoftCap: Check(_case(dataclasses.replace(GQA, logits_soft_cap=2.0)), _case()),
    # head_size 1: scale 1, and 1 * 1 == 1
    mutants.ScaleTwice: Check(_case(), _case(Options(8, 2, 1))),
    mutants.WrongKVHeads: Check(_case(), _case(Options(8, 1, 32))),  # MQA maps every head right
    mutants.ChunkedCausalOffset: Check(
        _case(query_lens=[3], seq_lens=[12]), _case(query_lens=[5, 1], seq_lens=[5, 9])
    ),
    mutants.WrongPrefill: Check(
        _case(query_lens=[5], seq_lens=[5]), _case(query_lens=[1, 1], seq_lens=[9, 4])
    ),
    mutants.ReadsPastSeqLen: Check(_case(), _case(fill="zero")),
    mutants.BlockTableIgnored: Check(_case(), _case(dataclasses.replace(GQA, encoder_only=True))),
    mutants.FailsUndeclared: Check(
        _case(dataclasses.replace(GQA, sinks=torch.linspace(-1.0, 2.0, 8))), _case()
    ),
}


@pytest.mark.parametrize("mutant", list(NUMERIC_CHECKS), ids=lambda m: m.__name__)
def test_mutant_is_wrong_where_it_should_be_and_right_elsewhere(mutant: type[Mutant]) -> None:
    """Its bug shows on the batch made for it; another batch, without that feature, is right."""
    check = NUMERIC_CHECKS[mutant]

    assert _error(mutant, **check.wrong) >= WRONG
    assert _error(mutant, **check.right) <= RIGHT


def test_bf16_accumulation_is_worse_than_naive_bf16_over_a_long_context() -> None:
    """Over 2048 keys its error is many times TORCH_SDPA's in bf16; over one chunk it is of
    the same order (both round to bf16), and float32 (not its path) is right."""
    long_case = _case(Options(4, 2, 64), [1], [2048], dtype=torch.bfloat16, block_size=16)
    float32_case = {**long_case, "dtype": torch.float32}
    short_case = _case(Options(4, 2, 64), [1], [mutants.ACCUMULATION_CHUNK], dtype=torch.bfloat16)

    pair = (TorchSDPABackend, mutants.Bf16Accumulation)
    base_long, long_error = (_error(b, **long_case) for b in pair)
    base_short, short_error = (_error(b, **short_case) for b in pair)

    assert long_error > 8 * base_long
    assert short_error < 4 * base_short + 2**-8
    assert _error(mutants.Bf16Accumulation, **float32_case) <= RIGHT


def _batch() -> tuple[Options, Batch]:
    return GQA, make_batch(GQA, *MIXED, 4, torch.float32)


def test_block_table_ignored_is_right_on_an_identity_table() -> None:
    """One sequence in blocks 0, 1, 2 (in order) with a cached prefix: the table it ignores
    says what it assumes."""
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 3, 4, 2, 32, generator=gen)
    metadata = AttentionMetadataBuilder(4).build([3], [11], [[0, 1, 2]])
    query, key, value = (torch.randn(3, h, 32, generator=gen) for h in (8, 2, 2))
    reference = paged_reference(query, key, value, kv_cache, metadata, scale=32**-0.5)
    impl = mutants.BlockTableIgnored.get_impl_cls()(8, 32, 32**-0.5, 2)

    result = impl.forward(None, query, key, value, kv_cache, metadata)

    assert torch.allclose(result.double(), reference, atol=RIGHT)


def test_batch_position_dependent_is_right_for_the_first_request_only() -> None:
    """The first request's rows equal TORCH_SDPA's bit for bit; the others are off."""
    opts, batch = _batch()
    expected = _forward(TorchSDPABackend, opts, batch)
    batch = make_batch(opts, *MIXED, 4, torch.float32)

    result = _forward(mutants.BatchPositionDependent, opts, batch)

    first = MIXED[0][0]
    assert torch.equal(result[:first], expected[:first])
    assert float((result[first:] - expected[first:]).abs().max()) >= WRONG * 1e-1


def test_nondeterministic_differs_between_identical_calls_by_an_ulp() -> None:
    """Two calls on the same inputs (and the same global seed) differ bitwise, each within
    one ulp of TORCH_SDPA's answer everywhere."""
    opts, _ = _batch()
    expected = _forward(TorchSDPABackend, opts, make_batch(opts, *MIXED, 4, torch.float32))
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        results.append(
            _forward(mutants.Nondeterministic, opts, make_batch(opts, *MIXED, 4, torch.float32))
        )

    assert not torch.equal(results[0], results[1])
    for result in results:
        ulp = torch.nextafter(expected, torch.full_like(expected, torch.inf)) - expected
        assert bool(((result - expected).abs() <= ulp).all())


def test_output_arg_ignored_leaves_the_buffer_and_returns_the_answer() -> None:
    """The returned tensor is right; the ``output=`` buffer keeps what it held."""
    opts, batch = _batch()
    impl = mutants.OutputArgIgnored.get_impl_cls()(**opts.impl_kwargs())
    output = torch.full((batch.query.shape[0], 8 * 32), -7.0)

    result = impl.forward(
        None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, output
    )

    assert result is not output
    assert bool((output == -7.0).all())
    assert float((result.double() - reference_attention(opts, batch)).abs().max()) <= RIGHT


def test_thread_unsafe_is_right_alone_and_wrong_with_two_threads() -> None:
    """Alone (main thread) it is right; two threads calling one impl at once on different
    batches get at least one wrong answer."""
    opts = GQA
    impl = mutants.ThreadUnsafe.get_impl_cls()(**opts.impl_kwargs())
    batches = [make_batch(opts, *MIXED, 4, torch.float32, seed=seed) for seed in (1, 2)]
    references = [reference_attention(opts, b) for b in batches]
    alone = impl.forward(None, *_inputs(batches[0]))
    results: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def call(index: int) -> None:
        barrier.wait()
        results[index] = impl.forward(None, *_inputs(batches[index]))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert float((alone.double() - references[0]).abs().max()) <= RIGHT
    errors = [
        float((results[i].double() - references[i]).abs().nan_to_num(torch.inf).max())
        for i in range(2)
    ]
    assert max(errors) >= WRONG


def _inputs(batch: Batch) -> tuple[Any, ...]:
    return batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata


CRASH_SCRIPT = """
import torch
from tests.backends.reference import Options, make_batch
from tests.conformance.mutants import CrashOnBadInput

opts = Options(8, 2, 32)
batch = make_batch(opts, [5, 1], [5, 9], 4, torch.float32)
impl = CrashOnBadInput.get_impl_cls()(**opts.impl_kwargs())
query = batch.query if {good} else batch.query[:, :4]  # 4 heads instead of 8
impl.forward(None, query, batch.key, batch.value, batch.kv_cache, batch.metadata)
print("ran")
"""


def _subprocess_env() -> dict[str, str]:
    """The environment of a child Python that imports this checkout's tests and src."""
    inherited = os.environ.get("PYTHONPATH")
    path = [str(ROOT), str(ROOT / "src"), *([inherited] if inherited else [])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@pytest.mark.parametrize("good", [True, False], ids=["good-input", "bad-input"])
def test_crash_on_bad_input_aborts_the_process(good: bool) -> None:
    """A good batch runs; a query with the wrong number of heads (TORCH_SDPA: a typed
    InvalidInputError) kills the process with SIGABRT."""
    script = textwrap.dedent(CRASH_SCRIPT).format(good=good)

    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )

    if good:
        assert (done.returncode, done.stdout.strip()) == (0, "ran"), done.stderr
    else:
        assert done.returncode == -signal.SIGABRT, done.stderr


def test_base_refuses_what_crash_on_bad_input_crashes_on() -> None:
    """The same bad input, in TORCH_SDPA itself, is a typed error (what the kit expects)."""
    opts, batch = _batch()
    impl = TorchSDPABackend.get_impl_cls()(**opts.impl_kwargs())

    with pytest.raises(InvalidInputError, match="query"):
        impl.forward(None, batch.query[:, :4], *_inputs(batch)[1:])


@pytest.mark.parametrize(
    "mutant", [mutants.WorksUndeclared, mutants.FailsUndeclared], ids=lambda m: m.__name__
)
def test_undeclared_sinks_are_refused_by_validation_and_accepted_by_the_impl(
    mutant: type[Mutant],
) -> None:
    """``validate_configuration(has_sink=True)`` refuses sinks; the impl takes them (no
    UnsupportedFeatureError), and WorksUndeclared computes them right."""
    reasons = mutant.validate_configuration(
        head_size=32,
        dtype=torch.float32,
        kv_cache_dtype="auto",
        block_size=4,
        use_mla=False,
        has_sink=True,
        use_sparse=False,
        device_capability=None,
    )
    opts = dataclasses.replace(GQA, sinks=torch.linspace(-1.0, 2.0, 8))

    error = _error(mutant, opts, *MIXED)

    assert reasons == ["sink setting not supported"]
    assert not mutant.supports_sink()
    assert (error <= RIGHT) == (mutant is mutants.WorksUndeclared)


def test_declares_soft_cap_declares_it() -> None:
    """DeclaresSoftCap takes ``logits_soft_cap`` where TORCH_SDPA refuses it."""
    opts = dataclasses.replace(GQA, logits_soft_cap=2.0)
    with pytest.raises(UnsupportedFeatureError, match="logits_soft_cap"):
        TorchSDPABackend.get_impl_cls()(**opts.impl_kwargs())

    impl = mutants.DeclaresSoftCap.get_impl_cls()(**opts.impl_kwargs())

    assert impl.logits_soft_cap == 2.0


def test_every_mutant_is_a_named_subclass_of_a_correct_backend() -> None:
    """Names are unique (``MUTANT_...``), each impl's ``backend`` is its own class, and
    every mutant is listed in MUTANTS and ``__all__``."""
    names = [m.get_name() for m in MUTANTS]
    listed = {name for name in mutants.__all__ if isinstance(getattr(mutants, name), type)}

    assert len(set(names)) == len(MUTANTS) >= 15
    assert all(name.startswith("MUTANT_") for name in names)
    assert all(m.get_impl_cls().backend is m for m in MUTANTS)
    assert {m.__name__ for m in MUTANTS} == listed - {"Mutant"}
    assert mutants.ScaleTwice.get_name() == "MUTANT_SCALE_TWICE"


# --- the kit's verdicts --------------------------------------------------------------------
#
# Each cell of a run is independent of the others (its batch follows from its id and the
# run's seed), so the default run's verdict on a cell is that of a run of that cell alone.
# A mutant is shown caught by the default run by running cells of the default plan that
# carry its feature, one at a time (cheapest first), until one gets the verdict it is owed:
# a few seconds per mutant instead of the whole default run.

#: Features whose cells are tried first: the bug needs them to show (a long context).
PREFER: dict[type[Mutant], str] = {mutants.Bf16Accumulation: "long_context"}


def _target(mutant: type[Mutant]) -> str:
    """The mutant's class path, as a user names a backend to ``attn-di conform``."""
    return f"{mutant.__module__}:{mutant.__qualname__}"


def _base(mutant: type[Mutant]) -> type[AttentionBackend]:
    """The correct attn_di backend the mutant is made of."""
    return next(c for c in mutant.__mro__ if c.__module__.startswith("attn_di.backends."))


@functools.cache
def _caught(mutant: type[Mutant]) -> tuple[ConformanceReport, ConformanceReport]:
    """The first default-plan cell with the mutant's feature (cheapest first) that gets the
    mutant's outcome and that the unmutated backend passes or refuses (the bug, not a false
    alarm, made it fail): the mutant's report and the base's, one cell each."""
    target = _target(mutant)
    default = plan_conformance(target)
    prefer = PREFER.get(mutant)
    candidates = sorted(
        (case for case in default.cases() if mutant.feature in case.features),
        key=lambda case: (prefer is not None and prefer not in case.features, case.seq_len),
    )
    assert candidates, f"the default run has no cell with feature {mutant.feature!r}"
    found = []
    for case in candidates:
        report = run_conformance(target, case_ids=[case.id])
        if report.results[0].outcome is Outcome[mutant.outcome]:
            control = run_conformance(_base(mutant), case_ids=[case.id])
            if control.ok:
                return report, control
            found.append(control.results[0].line())
    pytest.fail(
        f"the default run misses {mutant.__name__}: none of its {len(candidates)} cells with "
        f"feature {mutant.feature!r} is {mutant.outcome} where the unmutated backend conforms"
        + "".join(f"\n  base: {line}" for line in found)
    )


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_default_run_catches_mutant(mutant: type[Mutant]) -> None:
    """A cell of the default run that carries the mutant's feature gets the verdict the
    mutant is owed (FAIL, CRASH, FAIL_UNDECLARED; WORKS_UNDECLARED for the one that is right),
    the report is not ok (ok for that one), and the cell's report line and rerun command name
    it; the unmutated backend passes (or refuses) that very cell."""
    report, control = _caught(mutant)
    (result,) = report.results

    assert mutant.feature in result.case.features
    assert report.ok is mutant.report_ok
    assert (report.failures() == []) is mutant.report_ok
    assert result.line().startswith(f"{result.outcome.value.upper()} {result.case.id}")
    assert result.rerun.startswith(f"attn-di conform {_target(mutant)} --case {result.case.id}")
    assert control.results[0].outcome in (Outcome.PASS, Outcome.REFUSED)


BASES = [TorchSDPABackend, CPUAttentionBackend]


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.get_name())
def test_default_run_of_the_unmutated_bases_is_ok(base: type[AttentionBackend]) -> None:
    """No false alarm: the default run of each backend the mutants are made of is ok, with
    no FAIL, FAIL_UNDECLARED or CRASH cell. And a cell run alone ends as it does in the
    default run, to the bit (what :func:`_caught` relies on)."""
    report = run_conformance(base)
    alone = run_conformance(base, case_ids=[r.case.id for r in report.results[:4]])

    assert report.failures() == [], "\n".join(r.line() for r in report.failures())
    assert report.ok
    assert report.counts()["pass"] > 0
    for single, in_run in zip(alone.results, report.results, strict=False):
        assert (single.case, single.outcome, single.max_error, single.tolerance) == (
            in_run.case,
            in_run.outcome,
            in_run.max_error,
            in_run.tolerance,
        )


# --- the command and pytest ------------------------------------------------------------------


def conform(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m attn_di conform ARGS`` from the checkout's root, as a backend author runs
    it from their project (the class path is found from the current directory)."""
    return subprocess.run(
        [sys.executable, "-m", "attn_di", "conform", *args],
        cwd=ROOT,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _failing_ids(stdout: str) -> list[str]:
    """The ids of the ``FAIL <id>: ...`` lines of the command's output."""
    return [line.split()[1].rstrip(":") for line in stdout.splitlines() if line.startswith("FAIL ")]


def test_conform_fails_a_mutant_and_its_rerun_line_reruns_one_failing_cell() -> None:
    """``attn-di conform tests.conformance.mutants:ScaleTwice`` on the default matrix's
    float16 cells (the fewest: none long, none in a subprocess) exits 1 with a FAIL line and
    a rerun line per failing cell; a rerun line's command runs that one cell, which still
    fails (exit 1)."""
    target = _target(mutants.ScaleTwice)

    result = conform(target, "--dtype", "float16")

    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    reruns = [line.strip() for line in result.stdout.splitlines() if "rerun: " in line]
    fails = _failing_ids(result.stdout)
    assert fails
    assert all(case_id.startswith("fp16-") for case_id in fails)
    assert len(reruns) == len(fails)
    assert "NOT conformant" in result.stdout
    command = reruns[0].removeprefix("rerun: ")
    assert command.startswith(f"attn-di conform {target} --case fp16-")
    case_id = command.split("--case ")[1].split()[0]

    again = conform(*command.removeprefix("attn-di conform ").split())

    assert again.returncode == 1, again.stderr
    assert _failing_ids(again.stdout) == [case_id]
    assert "1 cell," in again.stdout


def _first_cell(mutant: type[Mutant]) -> str:
    """The id of the default plan's first cell with the mutant's feature."""
    plan = plan_conformance(_target(mutant))
    return next(case.id for case in plan.cases() if mutant.feature in case.features)


def test_conform_exit_codes_of_a_crash_and_of_works_undeclared() -> None:
    """One cell each: CrashOnBadInput's first malformed-input cell is a CRASH (exit 1);
    WorksUndeclared's undeclared-sinks cell works, not declared (exit 0: still conformant)."""
    crash_cell = _first_cell(mutants.CrashOnBadInput)
    works_cell = _first_cell(mutants.WorksUndeclared)

    crashed = conform(_target(mutants.CrashOnBadInput), "--case", crash_cell)
    conformant = conform(_target(mutants.WorksUndeclared), "--case", works_cell)

    assert crashed.returncode == 1, crashed.stderr
    assert f"CRASH {crash_cell}: the subprocess died of SIGABRT" in crashed.stdout
    assert conformant.returncode == 0, conformant.stdout + conformant.stderr
    assert "1 works_undeclared" in conformant.stdout
    assert "conformant" in conformant.stdout.splitlines()[-1]


PYTEST_MODULE = """
from attn_di.conformance import conformance_tests

test_x = conformance_tests({target!r}, case_ids={case_ids!r})
"""


def test_conformance_tests_in_a_backend_authors_suite(pytester: pytest.Pytester) -> None:
    """``test_x = conformance_tests("tests.conformance.mutants:WindowOffByOne", ...)`` gives one
    test per cell, with the cells' ids: the window cell the bug breaks fails with its report
    line and rerun command, a cell without a window passes, the cell TORCH_SDPA does not
    declare (the soft cap) is a skip naming the backend's reason."""
    mutant = mutants.WindowOffByOne
    caught, _ = _caught(mutant)
    failing = caught.results[0].case.id
    default = list(plan_conformance(_target(mutant)).cases())
    passing = next(c.id for c in default if not c.features & {"window", "softcap", "bad_input"})
    refused = next(c.id for c in default if "softcap" in c.features)
    pytester.makepyfile(
        test_backend=PYTEST_MODULE.format(
            target=_target(mutant), case_ids=[failing, passing, refused]
        )
    )

    result = pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-rfs")

    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"FAIL {failing}: max error *",
            f"rerun: attn-di conform {_target(mutant)} --case {failing} --seed 0",
            f"FAILED test_backend.py::test_x[[]{failing}[]]*",
            f"*SKIPPED*{mutant.get_name()}*",
        ]
    )


def test_pytest_option_collects_a_mutants_cells(pytester: pytest.Pytester) -> None:
    """``pytest --attn-di-conform=tests.conformance.mutants:SinksIgnored`` collects the
    default matrix's cells as items named by their ids; two of them (selected with ``-k``):
    the sinks cell fails, a cell without sinks passes."""
    mutant = mutants.SinksIgnored
    caught, _ = _caught(mutant)
    failing = caught.results[0].case.id
    default = list(plan_conformance(_target(mutant)).cases())
    passing = next(c.id for c in default if not c.features & {"sinks", "softcap", "bad_input"})

    collected = pytester.runpytest(
        "-p", "no:hypothesispytest", "-p", "no:cacheprovider",
        f"--attn-di-conform={_target(mutant)}", "--collect-only", "-q",
    )  # fmt: skip
    result = pytester.runpytest(
        "-p", "no:hypothesispytest", "-p", "no:cacheprovider",
        f"--attn-di-conform={_target(mutant)}", "-k", f"{failing} or {passing}",
    )  # fmt: skip

    names = [line for line in collected.stdout.lines if "attn-di-conform[" in line]
    assert len(names) == len(default)
    assert any(line.endswith(f"::{failing}") for line in names)
    result.assert_outcomes(passed=1, failed=1, deselected=len(default) - 2)
    result.stdout.fnmatch_lines([f"*FAIL {failing}: max error*", "*rerun: attn-di conform*"])
