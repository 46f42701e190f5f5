"""Bad arguments to the kit are refused by name before any cell runs: a run that would
select no cell, contradictory or out-of-range case ids, a seed, ``full``, ``dtypes`` or
``case_ids`` of the wrong type, a shard with no shards."""

from __future__ import annotations

import pytest

from attn_di.conformance import Case, plan_conformance, run_conformance
from attn_di.exceptions import InvalidInputError, UnknownBackendError
from tests.conformance.test_cli import conform

ONE = "fp32-gqa2-decode-len40-block16"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"shard": "90/100"}, "shard 90/100 of 83 cells"),
        ({"case_ids": ["bf16-gqa2-mixed-len60-block16"], "dtypes": ["float32"]}, "dtypes float32"),
        ({"case_ids": [ONE], "shard": "2/4"}, "shard 2/4 of 1 cell)"),
        ({"dtypes": []}, "dtypes (none)"),
    ],
)
def test_a_run_that_selects_no_cell_is_refused(options: dict[str, object], said: str) -> None:
    """It would check nothing and report "conformant": refused, saying which filters."""
    with pytest.raises(InvalidInputError) as raised:
        run_conformance("CPU_ATTN", **options)  # type: ignore[arg-type]
    assert raised.value.argument == "cells"
    assert "selects no cell of CPU_ATTN" in str(raised.value)
    assert said in str(raised.value)


@pytest.mark.parametrize(
    ("case_id", "problem"),
    [
        ("fp32-fp16-gqa2-mixed-len60", "'fp32' and 'fp16' both give its dtype"),
        ("fp32-gqa2-gqa4-decode-len60", "'gqa2' and 'gqa4' both give its gqa"),
        ("fp32-gqa2-decode-len60-len19", "'len60' and 'len19' both give its seq_len"),
        ("fp32-gqa2-mixed-len60-determinism-threads", "'determinism' and 'threads' both give"),
        ("fp32-gqa2-mixed-len999999-block16", "seq_len: must be between 1 and 32768"),
        ("fp32-gqa2-mixed-len0-block16", "seq_len: must be between 1 and 32768, got 0"),
        ("fp32-gqa2-mixed-len60-block8192", "block_size: must be between 1 and 4096"),
    ],
)
def test_a_contradictory_or_out_of_range_case_id_is_refused(case_id: str, problem: str) -> None:
    """Not the last token's cell run in silence, nor a cell too large to allocate: the id
    and what is wrong with it."""
    with pytest.raises(InvalidInputError) as raised:
        Case.from_id(case_id)
    assert raised.value.argument == "case id"
    assert repr(case_id) in str(raised.value)
    assert problem in str(raised.value)


@pytest.mark.parametrize(
    ("options", "argument", "problem"),
    [
        ({"seed": "x"}, "seed", "must be an int, got 'x' (str)"),
        ({"seed": True}, "seed", "must be an int, got True (bool)"),
        ({"full": "yes"}, "full", "must be True or False, got 'yes'"),
        ({"dtypes": "float16"}, "dtypes", "must be a list, got 'float16' (str)"),
        ({"case_ids": ONE}, "case_ids", "must be a list"),
        ({"case_ids": [3]}, "case_ids", "3 is not a case id"),
        ({"dtypes": ["float64"]}, "dtypes", "is not one of the matrix's dtypes: float32"),
        ({"shard": (0, 0)}, "shard", "N, the number of shards, must be >= 1"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_by_name(
    options: dict[str, object], argument: str, problem: str
) -> None:
    with pytest.raises(InvalidInputError) as raised:
        plan_conformance("CPU_ATTN", **options)  # type: ignore[arg-type]
    assert raised.value.argument == argument
    assert problem in str(raised.value)


def test_the_cli_names_its_options_and_takes_dtype_before_the_target() -> None:
    """--dtype takes one value (repeatable or comma-separated), so it can precede TARGET; its
    errors and --case's name the options; a run of no cell exits 2."""
    ran = conform("--dtype", "float32,bf16", "--case", ONE, "CPU_ATTN")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == "CPU_ATTN (CPU_ATTN): 1 cell, default matrix, seed 0"
    bad = conform("CPU_ATTN", "--dtype", "float8")
    assert bad.returncode == 2
    assert "--dtype: 'float8' is not one of the matrix's dtypes: float32, bfloat16, float16" in (
        bad.stderr
    )
    assert "float64" not in bad.stderr
    empty = conform("CPU_ATTN", "--shard", "90/100")
    assert empty.returncode == 2
    assert "selects no cell" in empty.stderr
    twice = conform("CPU_ATTN", "--case", "fp32-fp16-gqa2-mixed-len60")
    assert twice.returncode == 2
    assert "--case: 'fp32-fp16-gqa2-mixed-len60': 'fp32' and 'fp16' both give" in twice.stderr


def test_a_target_path_that_does_not_import_gets_a_targets_hint() -> None:
    """A class path given to conform is a target, not a registration: the hint says where its
    module must import from, not to register another class."""
    result = conform("nope_pkg.mod:Backend")
    assert result.returncode == 2
    assert "module not found (No module named 'nope_pkg')" in result.stderr
    assert "hint: check the path: its module must import from here" in result.stderr
    assert "register_backend" not in result.stderr


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("nope", "hint: give a member name (see `attn-di list`) or a class path"),
        ("cpu_atn", "hint: did you mean 'CPU_ATTN'?"),
    ],
)
def test_an_unknown_target_name_offers_backends_never_auto(name: str, hint: str) -> None:
    """conform checks one backend, so an unknown name lists the members and suggests the
    closest one, but never ``auto`` (which conform refuses) as a choice or a hint."""
    result = conform(name)
    assert result.returncode == 2
    assert f"Unknown attention backend: {name!r}. Valid options are: FLASH_ATTN" in result.stderr
    assert hint in result.stderr
    assert "auto" not in result.stderr


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("auto", "target: 'auto' asks for automatic selection, and conform checks one backend"),
        ("", "target: an empty name names no backend"),
    ],
)
def test_auto_or_no_name_is_refused_as_a_value_naming_the_target(name: str, said: str) -> None:
    """``auto`` (or nothing) is a wrong value, not a wrong type: the CLI says why conform needs
    one backend and where auto's choice is shown; the API raises InvalidInputError."""
    result = conform(name)
    assert result.returncode == 2
    assert said in result.stderr
    assert "`attn-di select` shows which one auto picks" in result.stderr
    with pytest.raises(InvalidInputError, match=r"conform checks one backend|empty name"):
        plan_conformance(name)


def test_all_keeps_its_own_hint_in_the_api() -> None:
    """`all` is the CLI's word for every backend (of `attn-di run`): conform's API error says so,
    rather than the generic hint for an unknown name."""
    with pytest.raises(UnknownBackendError) as caught:
        plan_conformance("all")
    assert "auto" not in caught.value.choices
    assert (caught.value.hint or "").startswith("`all` is accepted only by `attn-di run")
