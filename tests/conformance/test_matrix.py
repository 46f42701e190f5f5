"""The default matrix covers every pair of declared values, every edge and every check; the
full one is the whole product; both follow the backend's declarations."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from attn_di.conformance import BAD_INPUTS, KINDS, Capabilities, plan_conformance
from attn_di.conformance._matrix import (
    LONG,
    _compatible,
    axes_for,
    build_matrix,
    full_size,
    pairwise,
    to_case,
)

ALL = Capabilities(
    dtypes=("float32", "bfloat16", "float16"),
    head_sizes=None,
    block_size_ok=lambda size: True,
    attn_types=("decoder", "encoder", "encoder_only"),
    sliding_window=True,
    softcap=True,
    alibi=True,
    sinks=True,
)
"""What attn_di's CPU_ATTN declares."""


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_pairwise_cells_cover_every_compatible_pair(seed: int) -> None:
    """Every pair of values of two axes (that can be in one cell) is in some cell."""
    axes = axes_for(ALL)
    defaults = {axis.name: axis.values[0] for axis in axes}
    rows, total = pairwise(axes, seed)
    missing = []
    for first, second in itertools.combinations(axes, 2):
        for a, b in itertools.product(first.values, second.values):
            if not _compatible({first.name: a, second.name: b}, defaults):
                continue
            if not any(row[first.name] == a and row[second.name] == b for row in rows):
                missing.append((first.name, a, second.name, b))
    assert missing == []
    assert total > 700
    assert len(rows) < 60  # pairwise, not the product


def test_pairwise_cells_are_seeded() -> None:
    """A seed gives the same cells; another seed other cells."""
    ids = [[case.id for case in build_matrix(ALL, seed=seed)] for seed in (0, 0, 1)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


def test_the_default_matrix_has_every_edge_and_check() -> None:
    """Long contexts (>= 8k), window 1 and window >= the sequence, block sizes 1 and 256, an
    odd head size, every kind, grouping and dtype, and every check and malformed input."""
    cases = list(build_matrix(ALL))
    ids = {case.id for case in cases}
    assert len(ids) == len(cases)
    assert max(case.seq_len for case in cases if case.kind == "decode") >= LONG
    assert max(case.seq_len for case in cases if case.kind == "spec") >= LONG
    assert any(case.window == 1 for case in cases)
    assert any(case.window is not None and case.window >= case.seq_len for case in cases)
    assert {1, 256} <= {case.block_size for case in cases}
    assert any(case.head_size % 2 for case in cases)
    assert {case.kind for case in cases} == set(KINDS)
    assert {case.gqa for case in cases} == {"gqa1", "gqa2", "gqa4", "gqa8", "mqa"}
    assert {case.dtype for case in cases} == {"float32", "bfloat16", "float16"}
    assert {case.table for case in cases} == {"shuffled", "shared"}
    assert {case.check for case in cases} == {
        "numerics", "determinism", "batch_invariance", "threads", "bad_input",
    }  # fmt: skip
    assert {case.bad_input for case in cases} - {None} == set(BAD_INPUTS)
    features = set().union(*(case.features for case in cases))
    assert {"softcap", "alibi", "sinks", "output_arg", "padding", "long_context"} <= features


def test_undeclared_values_get_one_probe_each_and_no_pairwise_cell() -> None:
    """A backend without soft cap, fp32 or encoder attention: pairwise cells use declared
    values only; each undeclared value has one probe cell."""
    narrow = dataclasses.replace(
        ALL, dtypes=("bfloat16", "float16"), softcap=False, attn_types=("decoder",),
        head_sizes=(64, 128), block_size_ok=lambda size: size % 16 == 0,
    )  # fmt: skip
    rows, _ = pairwise(axes_for(narrow), 0)
    pairwise_ids = {to_case(row).id for row in rows}
    cases = list(build_matrix(narrow))
    probes = [case for case in cases if case.id not in pairwise_ids and case.check == "numerics"]
    assert all(to_case(row).softcap is None for row in rows)
    assert all(to_case(row).dtype != "float32" for row in rows)
    assert all(to_case(row).head_size in (64, 128) for row in rows)
    assert all(to_case(row).block_size % 16 == 0 for row in rows)
    assert sum(case.softcap is not None for case in cases) == 1
    assert sum(case.dtype == "float32" for case in cases) == 1
    assert sum(case.kind == "encoder" for case in cases) == 1
    assert sum(case.kind == "encoder_only" for case in cases) == 1
    assert sum(case.head_size not in (64, 128) for case in cases) == 1
    assert sum(case.block_size % 16 != 0 for case in probes if case.uses_cache) == 1


def test_the_full_matrix_is_the_product() -> None:
    """--full: every compatible combination of the axes, then the edges and checks."""
    axes = axes_for(dataclasses.replace(ALL, dtypes=("float32",), alibi=False, sinks=False))
    matrix = build_matrix(
        dataclasses.replace(ALL, alibi=False, sinks=False), full=True, dtypes=["float32"]
    )
    product = full_size(axes)
    assert len(matrix) > product > 10_000
    head = list(itertools.islice(iter(matrix), 50))
    assert len({case.id for case in head}) == 50


def test_a_plan_of_case_ids_runs_only_those() -> None:
    """case_ids: the named cells, whatever the matrix (dtypes still filter)."""
    plan = plan_conformance(
        "CPU_ATTN",
        case_ids=["bf16-gqa2-decode-len40-block16", "fp32-gqa2-decode-len40-block16"],
        dtypes=["bf16"],
    )
    assert [case.id for case in plan.cases()] == ["bf16-gqa2-decode-len40-block16"]
    assert plan.rerun(next(plan.cases())) == (
        "attn-di conform CPU_ATTN --case bf16-gqa2-decode-len40-block16 --seed 0"
    )


def test_a_contract_with_finite_tails_gets_finite_tail_cells_and_nan_tail_probes() -> None:
    """``nan_tails=False`` (vLLM's contract): every cache cell has finite tails but two
    probes with the kit's NaN tails; encoder cells are unchanged; the default (attn_di's
    contract) has no finite-tail cell at all."""
    finite = dataclasses.replace(ALL, nan_tails=False)
    cases = list(build_matrix(finite, seed=0))
    strict = [case.id for case in cases if case.uses_cache and not case.finite_tails]
    assert strict == ["bf16-gqa2-decode-len40-block16", "fp32-gqa2-mixed-len40-block16"]
    assert all(not case.finite_tails for case in cases if not case.uses_cache)
    assert len(cases) == len(list(build_matrix(ALL, seed=0))) + 2
    assert not any(case.finite_tails for case in build_matrix(ALL, seed=0))
    full = build_matrix(finite, full=True, dtypes=["float16"])
    assert {case.id for case in full if case.uses_cache and not case.finite_tails} == {
        "fp16-gqa2-decode-len40-block16",
        "fp16-gqa2-mixed-len40-block16",
    }
