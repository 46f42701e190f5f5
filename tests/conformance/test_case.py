"""A cell's id names it completely: parsed back to the same case, features read from it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_di.conformance import BAD_INPUTS, DTYPES, GQA, KINDS, Case, Outcome
from attn_di.exceptions import InvalidInputError

cases = st.builds(
    Case,
    dtype=st.sampled_from(list(DTYPES)),
    kind=st.sampled_from(KINDS),
    seq_len=st.integers(1, 10_000),
    head_size=st.integers(1, 512),
    gqa=st.sampled_from(list(GQA)),
    block_size=st.integers(1, 512),
    window=st.none() | st.integers(1, 10_000),
    softcap=st.none() | st.sampled_from([0.5, 2.0, 30.0, 50.0]),
    alibi=st.booleans(),
    sinks=st.booleans(),
    table=st.sampled_from(["shuffled", "shared"]),
    output=st.booleans(),
    padded=st.booleans(),
    finite_tails=st.booleans(),
)


@given(case=cases, check=st.sampled_from(["numerics", "determinism", "batch_invariance",
                                          "threads", *BAD_INPUTS]))  # fmt: skip
def test_an_id_parses_back_to_its_case(case: Case, check: str) -> None:
    """``Case.from_id(case.id)`` is the case, for every axis value and every check."""
    if check in BAD_INPUTS:
        case = case.with_(check="bad_input", bad_input=check)
    else:
        case = case.with_(check=check)
    assert Case.from_id(case.id) == case


def test_the_id_reads_as_its_configuration() -> None:
    """The issue's example id: dtype, grouping, kind, length, window, block size."""
    case = Case(dtype="bfloat16", gqa="gqa4", kind="decode", seq_len=150, window=50)
    assert case.id == "bf16-gqa4-decode-len150-window50-block16"
    assert case.num_heads == 8
    assert case.num_kv_heads == 2
    assert case.features == {"bf16", "gqa", "decode", "window", "shuffled_blocks", "dirty_cache"}


def test_encoder_cells_have_no_cache_axes() -> None:
    """An encoder cell's block size and table are fixed (it has no cache) and not in its id."""
    case = Case(kind="encoder_only", block_size=64, table="shared")
    assert (case.block_size, case.table) == (16, "shuffled")
    assert "block" not in case.id
    assert case.features == {"fp32", "encoder", "encoder_only"}
    assert case.attn_type == "encoder_only"
    assert not case.causal


def test_a_mistyped_id_names_the_token_and_the_closest_one() -> None:
    """An unknown token is refused with a hint at the nearest token."""
    with pytest.raises(InvalidInputError) as caught:
        Case.from_id("bf16-gqa4-decod-len150")
    assert "unknown token 'decod'" in str(caught.value)
    assert caught.value.hint is not None
    assert caught.value.hint.startswith("did you mean 'decode'?")


def test_values_out_of_range_are_refused() -> None:
    """A non-positive length or window, an unknown dtype, a bad_input without the check."""
    with pytest.raises(InvalidInputError, match="seq_len"):
        Case(seq_len=0)
    with pytest.raises(InvalidInputError, match="window"):
        Case(window=0)
    with pytest.raises(InvalidInputError, match="did you mean 'bfloat16'"):
        Case(dtype="bfloat")
    with pytest.raises(InvalidInputError, match="bad_input"):
        Case(bad_input="query_shape")


def test_each_cell_has_its_own_data_seed() -> None:
    """The data seed mixes the run's seed with the id."""
    first, second = Case(), Case(seq_len=20)
    assert first.data_seed(0) != second.data_seed(0)
    assert first.data_seed(0) != first.data_seed(1)
    assert first.data_seed(3) == Case().data_seed(3)


def test_which_outcomes_conform() -> None:
    """Pass, refused and works-undeclared conform; the failures and a crash do not."""
    assert {o for o in Outcome if o.conformant} == {
        Outcome.PASS,
        Outcome.REFUSED,
        Outcome.WORKS_UNDECLARED,
    }


def test_finite_tails_fill_the_used_blocks_with_finite_values_only() -> None:
    """A ``finitetails`` cell: the unwritten slots of the blocks a sequence uses hold +-max,
    the blocks none uses keep the NaN and Inf; the same cell without it has NaN tails."""
    import torch

    from attn_di.conformance._problem import make_problem

    case = Case.from_id("fp32-gqa2-decode-len40-block16-finitetails")
    assert case.finite_tails
    assert "finite_tails" in case.features
    problem = make_problem(case, seed=0)
    used, spare = _used_and_spare_blocks(problem)
    assert spare
    largest = torch.finfo(torch.float32).max
    assert bool(problem.cache[:, used].isfinite().all())
    assert bool((problem.cache[:, used].abs() == largest).any())
    assert bool(problem.cache[:, spare].isnan().any())
    strict = make_problem(case.with_(finite_tails=False), seed=0)
    strict_used, _ = _used_and_spare_blocks(strict)
    assert bool(strict.cache[:, strict_used].isnan().any())


def _used_and_spare_blocks(problem: Any) -> tuple[list[int], list[int]]:
    import math

    used: set[int] = set()
    for row, length in enumerate(problem.seq_lens):
        used.update(int(b) for b in problem.block_table[row, : math.ceil(length / 16)])
    spare = set(range(problem.cache.shape[1])) - used
    return sorted(used), sorted(spare)
