"""The tolerance rule: how far from the float64 reference a backend's output may be.

The tolerance comes from the dtype itself, on the cell's own inputs, as PyTorch's SDPA and
flex-attention tests derive theirs: the same attention is computed naively in the model
dtype (inputs in the dtype, every matmul, the soft cap, the bias and the softmax in the
dtype: :func:`attn_di.reference.sequence_attention` with ``dtype=``), and its error against
float64 measured. For every sequence ``i`` of the batch::

    tolerance[i] = max(FACTOR * max |naive - reference|,
                       (ULPS * eps(dtype) + FP32_ULPS * eps(float32)) * max |reference|)

the maxima over the sequence's outputs (all its tokens, heads and dims), ``eps`` being
``torch.finfo(dtype).eps``. A backend passes a cell when every real output element is finite
and within its sequence's tolerance.

The floor is what a correct backend errs by whatever the naive error: rounding its output
to the dtype (up to half an ulp; one more rounding of an intermediate, e.g. an additive mask
in the dtype) plus its float32 arithmetic (exp approximations, another summation order).
Without it a sequence of one token, whose naive answer is exact, would demand an exact
answer. The constants were set on attn_di's backends (CPU_ATTN's compiled and pure-torch
paths, TORCH_SDPA, FLEX_ATTENTION) over eight seeds of the default matrix, where no sequence
used more than 45% of its tolerance. A backend that keeps a running sum in the model dtype
over a long context (a bfloat16 online-softmax state over 8k keys) errs several times
the naive computation, which rounds each operation's result but accumulates inside each
operation in float32, and fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FACTOR", "FP32_ULPS", "ULPS", "Judgement", "judge", "tolerance_rule"]

FACTOR = 4.0
"""How many times the naive dtype computation's error a backend may make."""
ULPS = 2.0
"""The floor's part in ``eps(dtype)``, times the sequence's largest reference output."""
FP32_ULPS = 64.0
"""The floor's part in ``eps(float32)`` (float32 arithmetic inside any backend)."""

_POSITIONS = 5


def tolerance_rule(
    reference: torch.Tensor,
    naive: torch.Tensor,
    dtype: torch.dtype,
    sequence_of_token: torch.Tensor,
) -> torch.Tensor:
    """The per-element tolerance of a cell (the rule in this module's docstring).

    Args:
        reference: ``[N, H, D]`` float64, the reference output of the real tokens.
        naive: ``[N, H, D]``, the same attention computed naively in ``dtype``.
        dtype: the model dtype.
        sequence_of_token: ``[N]`` int64, the batch index of each token.

    Returns:
        ``[N, H, D]`` float64 tolerances (equal over each sequence).
    """
    import torch

    floor = ULPS * torch.finfo(dtype).eps + FP32_ULPS * torch.finfo(torch.float32).eps
    error = (naive.double() - reference).abs().nan_to_num(nan=torch.inf).amax(dim=(1, 2))  # [N]
    magnitude = reference.abs().amax(dim=(1, 2))
    seqs = int(sequence_of_token.max()) + 1 if sequence_of_token.numel() else 0
    worst = torch.zeros(seqs, dtype=torch.float64).scatter_reduce(
        0, sequence_of_token, error, "amax", include_self=True
    )
    largest = torch.zeros(seqs, dtype=torch.float64).scatter_reduce(
        0, sequence_of_token, magnitude, "amax", include_self=True
    )
    per_sequence = torch.maximum(FACTOR * worst, floor * largest)
    return per_sequence[sequence_of_token][:, None, None].expand_as(reference)


@dataclass(frozen=True)
class Judgement:
    """A comparison of an output with the reference.

    Attributes:
        ok: every element finite and within tolerance.
        max_error: the largest absolute error (``inf`` for a NaN or Inf output).
        tolerance: the tolerance at the element with the worst error-to-tolerance ratio.
        first_wrong: the first ``(token, head, dim)`` positions beyond tolerance.
    """

    ok: bool
    max_error: float
    tolerance: float
    first_wrong: list[tuple[int, int, int]]


def judge(output: torch.Tensor, reference: torch.Tensor, tolerance: torch.Tensor) -> Judgement:
    """Compare ``output`` ``[N, H, D]`` (any dtype) with ``reference`` under ``tolerance``."""
    import torch

    error = (output.double() - reference).abs()
    error = torch.where(torch.isfinite(output.double()), error, torch.inf)
    wrong = error > tolerance
    if error.numel() == 0:
        return Judgement(True, 0.0, 0.0, [])
    ratio = error / tolerance.clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(torch.argmax(ratio.nan_to_num(nan=torch.inf)))
    positions = [(int(t), int(h), int(d)) for t, h, d in wrong.nonzero()[:_POSITIONS].tolist()]
    return Judgement(
        ok=not bool(wrong.any()),
        max_error=float(error.max()),
        tolerance=float(tolerance.reshape(-1)[worst]),
        first_wrong=positions,
    )
