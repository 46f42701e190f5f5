"""Shards: the N shards of one run hold every cell exactly once, in the run's order; a bad
shard is refused by name; the CLI, the report and the pytest option carry the shard."""

from __future__ import annotations

import itertools
import json

import pytest

from attn_di.conformance import plan_conformance
from attn_di.conformance._runner import parse_shard
from attn_di.exceptions import InvalidInputError
from tests.conformance.test_cli import conform


@pytest.mark.parametrize("count", [1, 3, 7])
def test_the_shards_of_a_run_hold_every_cell_once_in_order(count: int) -> None:
    whole = [case.id for case in plan_conformance("CPU_ATTN", seed=3).cases()]
    shards = [
        plan_conformance("CPU_ATTN", seed=3, shard=f"{k}/{count}") for k in range(1, count + 1)
    ]
    parts = [[case.id for case in shard.cases()] for shard in shards]
    assert [len(shard) for shard in shards] == [len(part) for part in parts]
    assert sum(len(part) for part in parts) == len(whole)
    # round robin: the k-th shard holds cells k-1, k-1+N, ... of the whole run
    assert parts == [whole[k::count] for k in range(count)]
    merged = [cid for row in itertools.zip_longest(*parts) for cid in row if cid is not None]
    assert merged == whole


def test_a_shard_of_the_full_product_is_generated_lazily() -> None:
    """Shard 2 of 100,000 of the full product: its length without iterating it, and its
    first cells are the product's cells 1 and 100,001."""
    whole = plan_conformance("CPU_ATTN", full=True)
    shard = plan_conformance("CPU_ATTN", full=True, shard=(2, 100_000))
    assert len(shard) == len(range(1, len(whole), 100_000))
    first = list(itertools.islice(shard.cases(), 2))
    expected = list(itertools.islice(whole.cases(), 1, 100_002, 100_000))
    assert [c.id for c in first] == [c.id for c in expected]


@pytest.mark.parametrize(
    ("shard", "problem", "closest"),
    [
        ("0/4", "K must be between 1 and N", "1/4"),
        ("5/4", "K must be between 1 and N", "4/4"),
        ("2-4", "is not K/N", None),
        ((1, 2, 3), "is not K/N", None),
        ((True, 2), "is not K/N", None),
    ],
)
def test_a_bad_shard_is_refused_by_name(shard: object, problem: str, closest: str | None) -> None:
    with pytest.raises(InvalidInputError) as raised:
        plan_conformance("CPU_ATTN", shard=shard)  # type: ignore[arg-type]
    assert raised.value.argument == "shard"
    assert problem in str(raised.value)
    assert repr(shard) in str(raised.value)
    if closest is not None:
        assert f"the closest is {closest}" in (raised.value.hint or "")


def test_parse_shard_accepts_spaces_and_tuples() -> None:
    assert parse_shard(" 2 / 5 ") == (2, 5)
    assert parse_shard((5, 5)) == (5, 5)
    assert parse_shard(None) is None


def test_the_cli_runs_one_shard_and_says_so() -> None:
    """Three cells given by id, shard 2/3: only the second runs; the title and JSON say which
    shard; a bad shard is one line with the hint, exit 2, no traceback."""
    ids = [
        "fp32-gqa2-decode-len40-block16",
        "fp32-gqa1-prefill-len24-block16",
        "bf16-gqa4-mixed-len19-window6-block16",
    ]
    cases = [arg for cid in ids for arg in ("--case", cid)]
    result = conform("CPU_ATTN", *cases, "--shard", "2/3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["shard"] == "2/3"
    assert [cell["id"] for cell in data["results"]] == [ids[1]]
    table = conform("CPU_ATTN", *cases, "--shard", "2/3")
    assert table.stdout.splitlines()[0] == (
        "CPU_ATTN (CPU_ATTN): 1 cell, default matrix, shard 2/3, seed 0"
    )
    bad = conform("CPU_ATTN", "--shard", "4/3")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert "shard: '4/3': K must be between 1 and N" in bad.stderr
    assert "the closest is 3/3" in bad.stderr


def test_the_pytest_option_collects_one_shard(pytester: pytest.Pytester) -> None:
    """``--attn-di-conform-shard=K/N`` collects the K-th shard's cells, in order; a bad
    shard is a usage error naming it."""
    whole = [case.id for case in plan_conformance("CPU_ATTN").cases()]
    listed = _pytest(pytester, "--attn-di-conform-shard=3/40", "--co", "-q")
    prefix = "attn-di-conform[CPU_ATTN]::"
    collected = [line[len(prefix) :] for line in listed.stdout.lines if line.startswith(prefix)]
    assert collected == whole[2::40]
    refused = _pytest(pytester, "--attn-di-conform-shard=0/40", "--co", "-q")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--attn-di-conform: shard: '0/40': K must be between*"])


def _pytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--attn-di-conform=CPU_ATTN", *args
    )  # fmt: skip
