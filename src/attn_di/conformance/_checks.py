"""The checks of a cell (torch): numerics against the reference, determinism, batch
invariance, two threads at once, a malformed input. Each returns a :class:`Verdict`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from attn_di.conformance._case import Case, Outcome
from attn_di.conformance._driver import BoundBatch, Capabilities, Driver
from attn_di.conformance._problem import (
    Problem,
    assemble,
    layer_options,
    make_problem,
    make_sequences,
)
from attn_di.conformance._tolerance import judge, tolerance_rule
from attn_di.reference import sequence_attention

__all__ = ["CHECKS", "Raised", "Verdict", "bad_input", "expected"]

_T = TypeVar("_T")
_MESSAGE_CHARS = 300
_THREAD_ROUNDS = 16


class Raised(Exception):
    """The backend raised ``error`` while ``stage`` (constructing the impl, forward)."""

    def __init__(self, stage: str, error: Exception) -> None:
        super().__init__(stage, error)
        self.stage = stage
        self.error = error


def _attempt(stage: str, function: Callable[..., _T], *args: Any) -> _T:
    try:
        return function(*args)
    except Exception as error:
        raise Raised(stage, error) from error


def describe(error: BaseException) -> str:
    """``Type: first line of the message`` (cut to a few hundred characters)."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > _MESSAGE_CHARS:
        first = first[: _MESSAGE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@dataclass
class Verdict:
    """What a check found: correct or not (None when the backend raised), and why."""

    correct: bool | None
    reason: str | None = None
    max_error: float | None = None
    tolerance: float | None = None
    first_wrong: list[tuple[int, int, int]] = field(default_factory=list)
    refusal: bool = False

    @classmethod
    def from_raised(cls, raised: Raised, declared: bool, reasons: list[str], case: Case) -> Verdict:
        """The verdict of a cell whose backend raised: a refusal if the error is typed."""
        from attn_di.conformance._runner import REFUSALS

        typed = isinstance(raised.error, REFUSALS)
        what = f"{raised.stage} raised {describe(raised.error)}"
        if declared:
            return cls(None, f"declared, but {what}")
        if typed:
            return cls(None, describe(raised.error), refusal=True)
        return cls(None, f"not declared, and {what}: not a typed refusal")

    def outcome(self, declared: bool) -> Outcome:
        """The cell's outcome, given whether the backend declares it."""
        if self.correct is None:
            if declared:
                return Outcome.FAIL
            return Outcome.REFUSED if self.refusal else Outcome.FAIL_UNDECLARED
        if self.correct:
            return Outcome.PASS if declared else Outcome.WORKS_UNDECLARED
        return Outcome.FAIL if declared else Outcome.FAIL_UNDECLARED


@dataclass(frozen=True)
class Expected:
    """The reference of a batch's real tokens and their tolerances, ``[N, H, D]`` float64."""

    reference: torch.Tensor
    tolerance: torch.Tensor


def expected(problem: Problem) -> Expected:
    """The float64 reference and the tolerance rule's bound for every real output element."""
    layer = problem.layer
    options = {
        "causal": problem.causal,
        "sliding_window": layer.window,
        "logits_soft_cap": layer.softcap,
        "alibi_slopes": layer.alibi_slopes,
        "sinks": layer.sinks,
    }
    references, naives = [], []
    for sequence in problem.sequences:
        keys, values = sequence.full_keys(), sequence.full_values()
        references.append(
            sequence_attention(sequence.query, keys, values, layer.scale, **options)  # type: ignore[arg-type]
        )
        naives.append(
            sequence_attention(
                sequence.query,
                keys,
                values,
                layer.scale,
                dtype=problem.dtype,
                **options,  # type: ignore[arg-type]
            )
        )
    reference = torch.cat(references)
    naive = torch.cat(naives)
    tolerance = tolerance_rule(reference, naive, problem.dtype, problem.sequence_of_token())
    return Expected(reference, tolerance)


def _output_buffer(problem: Problem) -> torch.Tensor:
    layer = problem.layer
    rows = int(problem.query.shape[0])
    return torch.full((rows, layer.num_heads * layer.head_size), float("nan"), dtype=problem.dtype)


def _rows(problem: Problem, output: torch.Tensor) -> torch.Tensor | str:
    """The real tokens' ``[N, H, D]`` rows, or why the output cannot hold them."""
    layer = problem.layer
    shape = (int(problem.query.shape[0]), layer.num_heads * layer.head_size)
    if not isinstance(output, torch.Tensor):
        return f"forward returned {type(output).__name__}, not a tensor"
    if tuple(output.shape) != shape:
        return f"forward returned shape {tuple(output.shape)}, expected [N, H * D] = {shape}"
    if output.dtype != problem.dtype:
        return f"forward returned {output.dtype}, expected the query's {problem.dtype}"
    return output[: problem.num_tokens].reshape(
        problem.num_tokens, layer.num_heads, layer.head_size
    )


def _examine(problem: Problem, want: Expected, output: torch.Tensor, bound: BoundBatch) -> Verdict:
    """The output against the reference, then the cache against the expected write."""
    rows = _rows(problem, output)
    if isinstance(rows, str):
        return Verdict(False, rows)
    verdict = judge(rows, want.reference, want.tolerance)
    cache_problem = _cache_problem(problem, bound)
    reasons = []
    if not verdict.ok:
        reasons.append(
            "output beyond tolerance" if verdict.max_error != float("inf") else "non-finite output"
        )
    if cache_problem:
        reasons.append(cache_problem)
    return Verdict(
        verdict.ok and cache_problem is None,
        "; ".join(reasons) or None,
        verdict.max_error,
        verdict.tolerance,
        verdict.first_wrong,
    )


def _differs(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return (after != before) & ~(after.isnan() & before.isnan())


def _cache_problem(problem: Problem, bound: BoundBatch) -> str | None:
    """Whether ``forward`` wrote exactly the batch's keys and values at their slots."""
    found = bound.cache_problem()
    if found is not None:
        return found
    after = bound.cache()
    if after is None or problem.cache is None or problem.slots is None:
        return None
    kv_heads, size = problem.layer.num_kv_heads, problem.layer.head_size
    want = problem.cache.clone()
    want[0].view(-1, kv_heads, size)[problem.slots] = problem.key[: problem.num_tokens]
    want[1].view(-1, kv_heads, size)[problem.slots] = problem.value[: problem.num_tokens]
    if tuple(after.shape) != tuple(want.shape):
        return f"the cache's shape changed to {tuple(after.shape)}"
    wrong = _differs(after, want).reshape(2, -1, kv_heads * size).any(dim=-1)  # [2, slots]
    if not bool(wrong.any()):
        return None
    plane, slot = (int(i) for i in wrong.nonzero()[0])
    written = set(problem.slots.tolist())
    where = "a slot of the batch's new tokens" if slot in written else "a slot no new token maps to"
    return (
        f"KV-cache write: {int(wrong.sum())} slot(s) of the cache differ from the expected "
        f"write, first the {'value' if plane else 'key'} of slot {slot} ({where})"
    )


def numerics(driver: Driver, case: Case, seed: int, caps: Capabilities) -> Verdict:
    """The output (and the cache write) against the reference."""
    problem = make_problem(case, seed)
    impl = _attempt("constructing the impl", driver.make_impl, problem)
    bound = _attempt("binding the batch", driver.bind, impl, problem)
    buffer = _output_buffer(problem) if case.output else None
    output = _attempt("forward", bound.forward, buffer)
    return _examine(problem, expected(problem), output, bound)


def determinism(driver: Driver, case: Case, seed: int, caps: Capabilities) -> Verdict:
    """Correct, and the same call twice bitwise equal (output and cache)."""
    problem = make_problem(case, seed)
    impl = _attempt("constructing the impl", driver.make_impl, problem)
    bound = _attempt("binding the batch", driver.bind, impl, problem)
    first = _attempt("forward", bound.forward, None).clone()
    first_cache = None if bound.cache() is None else bound.cache().clone()  # type: ignore[union-attr]
    verdict = _examine(problem, expected(problem), first, bound)
    if not verdict.correct:
        return verdict
    second = _attempt("forward (again)", bound.forward, None)
    count = problem.num_tokens
    if not _bitwise_equal(first[:count], second[:count]):
        gap = _largest_gap(first[:count], second[:count])
        return Verdict(
            False, f"the same call twice gave different outputs (largest difference {gap:.3g})"
        )
    cache = bound.cache()
    if first_cache is not None and cache is not None and bool(_differs(cache, first_cache).any()):
        return Verdict(False, "the same call twice left different caches")
    return verdict


def batch_invariance(driver: Driver, case: Case, seed: int, caps: Capabilities) -> Verdict:
    """Request 0 alone, first of the batch and last of the batch: each correct, and the
    three outputs within tolerance of each other (bitwise equal where the backend declares
    batch invariance)."""
    layer = layer_options(case, seed)
    sequences = make_sequences(case, seed)
    batches = {
        "alone": [sequences[0]],
        "first of the batch": sequences,
        "last of the batch": [*sequences[1:], sequences[0]],
    }
    impl = None
    rows: dict[str, torch.Tensor] = {}
    want0: Expected | None = None
    for name, members in batches.items():
        problem = assemble(case, layer, members, seed)
        if impl is None:
            impl = _attempt("constructing the impl", driver.make_impl, problem)
        bound = _attempt("binding the batch", driver.bind, impl, problem)
        output = _attempt("forward", bound.forward, None)
        want = expected(problem)
        verdict = _examine(problem, want, output, bound)
        if not verdict.correct:
            verdict.reason = f"request 0 {name}: {verdict.reason}"
            return verdict
        position = next(i for i, member in enumerate(members) if member is sequences[0])
        start = sum(s.query_len for s in members[:position])
        count = sequences[0].query_len
        real = _rows(problem, output)
        assert isinstance(real, torch.Tensor)
        rows[name] = real[start : start + count]
        if name == "alone":
            want0 = want
    assert want0 is not None
    alone = rows["alone"]
    for name in ("first of the batch", "last of the batch"):
        if caps.batch_invariant:
            if not _bitwise_equal(rows[name], alone):
                return Verdict(
                    False,
                    f"declared batch-invariant, but request 0 {name} is not bitwise equal to "
                    "request 0 alone",
                )
            continue
        gap = judge(rows[name], alone.double(), want0.tolerance)
        if not gap.ok:
            return Verdict(
                False,
                f"request 0 {name} differs from request 0 alone beyond tolerance",
                gap.max_error,
                gap.tolerance,
                gap.first_wrong,
            )
    return Verdict(True)


def threads(driver: Driver, case: Case, seed: int, caps: Capabilities) -> Verdict:
    """Two threads calling one impl's ``forward`` at once, each on its own batch and cache,
    16 times: every output and cache correct."""
    problems = [make_problem(case, seed), make_problem(case.with_(), seed + 1)]
    impl = _attempt("constructing the impl", driver.make_impl, problems[0])
    bounds = [_attempt("binding the batch", driver.bind, impl, p) for p in problems]
    wants = [expected(p) for p in problems]
    barrier = threading.Barrier(2)
    found: list[list[Any]] = [[], []]

    def work(index: int) -> None:
        for _ in range(_THREAD_ROUNDS):
            try:
                barrier.wait(timeout=60)
                output = bounds[index].forward(None).clone()
                cache = bounds[index].cache()
                found[index].append((output, None if cache is None else cache.clone()))
            except Exception as error:
                found[index].append(error)
                barrier.abort()  # the other thread stops waiting for this one at once
                return

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    for index, results in enumerate(found):
        for result in results:
            if isinstance(result, Exception):
                if isinstance(result, threading.BrokenBarrierError):
                    continue
                raise Raised(f"forward in thread {index}", result)
            output, cache = result
            verdict = _examine(problems[index], wants[index], output, _Frozen(cache))
            if not verdict.correct:
                verdict.reason = f"thread {index}: {verdict.reason}"
                return verdict
    if any(len(r) < _THREAD_ROUNDS for r in found):
        return Verdict(False, "a thread did not finish its calls")
    return Verdict(True)


class _Frozen(BoundBatch):
    """A cache captured after a call, for :func:`_examine`."""

    def __init__(self, cache: torch.Tensor | None) -> None:
        self._cache = cache

    def forward(self, output: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def cache(self) -> torch.Tensor | None:
        return self._cache

    def forward_malformed(self, what: str) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def bad_input(driver: Driver, case: Case, seed: int) -> Verdict:
    """A malformed input must raise a typed error (in the subprocess that runs this)."""
    from attn_di.conformance._runner import TYPED_ERRORS

    assert case.bad_input is not None
    problem = make_problem(case, seed)
    impl = _attempt("constructing the impl", driver.make_impl, problem)
    bound = _attempt("binding the batch", driver.bind, impl, problem)
    try:
        bound.forward_malformed(case.bad_input)
    except TYPED_ERRORS as error:
        return Verdict(True, f"refused: {describe(error)}")
    except Exception as error:
        return Verdict(False, f"raised {describe(error)}: not a typed error")
    return Verdict(False, f"accepted a malformed input ({case.bad_input}) without an error")


def _bitwise_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.shape == second.shape and not bool(_differs(first, second).any())


def _largest_gap(first: torch.Tensor, second: torch.Tensor) -> float:
    return float((first.double() - second.double()).abs().nan_to_num(nan=float("inf")).max())


CHECKS: dict[str, Callable[[Driver, Case, int, Capabilities], Verdict]] = {
    "numerics": numerics,
    "determinism": determinism,
    "batch_invariance": batch_invariance,
    "threads": threads,
}
"""The in-process checks by :attr:`Case.check`."""
