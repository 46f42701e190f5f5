"""The tolerance rule: derived from the dtype's own naive error, floored; strict enough that
bfloat16 accumulation over a long context fails, lenient enough for rounding."""

from __future__ import annotations

import math

import torch

from attn_di.conformance import Outcome, run_conformance
from attn_di.conformance._tolerance import FACTOR, FP32_ULPS, ULPS, judge, tolerance_rule
from tests.conformance.kit_backends import Bf16AccumulatingBackend


def test_bf16_accumulation_over_a_long_context_fails() -> None:
    """A running softmax state kept in bfloat16 passes over 40 tokens and fails over 8k (by
    several times the tolerance); the same code in float32 passes over 8k."""
    report = run_conformance(
        Bf16AccumulatingBackend,
        case_ids=[
            "bf16-gqa2-decode-len40-block16",
            "bf16-gqa2-decode-len8192-block16",
            "fp32-gqa2-decode-len8192-block16",
        ],
    )
    short, long, fp32 = report.results
    assert short.outcome is Outcome.PASS
    assert long.outcome is Outcome.FAIL
    assert long.max_error is not None
    assert long.tolerance is not None
    assert long.max_error > 3 * long.tolerance
    assert long.reason == "output beyond tolerance"
    assert long.first_wrong[0] == (0, 0, 0)
    assert fp32.outcome is Outcome.PASS


def test_the_tolerance_is_a_multiple_of_the_naive_error_per_sequence() -> None:
    """Each sequence's tolerance is FACTOR times its naive error, where that is larger than
    the floor; equal over the sequence's tokens, heads and dims."""
    reference = torch.zeros(3, 2, 4, dtype=torch.float64)
    reference[:, :, 0] = 1.0
    naive = reference.clone()
    naive[0, 1, 2] = 0.1  # sequence 0's naive error
    sequence_of_token = torch.tensor([0, 0, 1])
    tolerance = tolerance_rule(reference, naive, torch.bfloat16, sequence_of_token)
    floor = ULPS * torch.finfo(torch.bfloat16).eps + FP32_ULPS * torch.finfo(torch.float32).eps
    assert torch.all(tolerance[:2] == FACTOR * 0.1)
    assert torch.allclose(tolerance[2], torch.full((2, 4), floor, dtype=torch.float64))


def test_judging_names_the_first_wrong_positions_and_counts_nan_as_wrong() -> None:
    """Positions (token, head, dim) in order; a NaN output is an infinite error."""
    reference = torch.zeros(2, 2, 3, dtype=torch.float64)
    tolerance = torch.full_like(reference, 0.01)
    output = torch.zeros(2, 2, 3)
    output[1, 0, 2] = 0.5
    output[0, 1, 1] = math.nan
    verdict = judge(output, reference, tolerance)
    assert not verdict.ok
    assert verdict.first_wrong == [(0, 1, 1), (1, 0, 2)]
    assert verdict.max_error == math.inf
    assert judge(torch.zeros(2, 2, 3), reference, tolerance).ok
