"""CPU_ATTN's kernels on AMX tiles (the ``amx`` build, bfloat16 caches).

Two paths read the paged cache in place on tiles. ``run_item_amx`` multiplies both products on
tiles: key rows straight into tiles where 16 of them are one block's consecutive slots,
gathered where not; value rows interleaved in pairs. One-token items of at most 16 query heads
per KV head take ``tile_scores`` and ``tile_values``: the scores on tiles as narrow as the KV
head's query rows, stored straight into the score block, and P V with the value rows in place
as B tiles (even and odd columns from two A tiles of the probabilities); an item whose P V
there holds a NaN (a non-finite value, which the zero half of an A tile spreads to the
neighbouring column) is redone on vector registers.
These cases cross each branch (column chunks of 16 query rows, one to more than four per KV
head; KV heads in groups of four C tiles and a partial group; tiles inside a block, across
blocks and past the item; head sizes of one to eight tiles of 32; every layer option; every
cache layout) against the float64 reference on caches whose unused slots hold NaN and Inf,
and ask the kernel which path ran (``torch.ops.attn_di.decode_items``): equal outputs cannot
tell one path from another.

The prefill kernel's bfloat16 GEMMs run on tiles too in this build, where D is a multiple of
32 (``S = Q K^T`` and ``O += P V``, 32 rows x 32 columns a step, B packed into tile order per
key tile), and on oneDNN's GEMMs elsewhere: ``torch.ops.attn_di.prefill_items`` says which.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_di.backends import _cpu_kernel
from tests.backends.reference import Options, make_batch, reference_attention
from tests.backends.test_cpu_kernel import (
    TOLERANCES,
    assert_matches,
    requires_kernel,
    run_both_paths,
)


def _amx_active() -> bool:
    status = _cpu_kernel.kernel_status()
    return status.active and status.isa == "amx" and "AMX tiles" in (status.bfloat16 or "")


requires_amx = pytest.mark.skipif("not _amx_active()", reason="needs the amx build on AMX")


PATHS = ("amx", "tiles", "vector")


def _decode_items() -> tuple[int, int, int, int]:
    """Decode items run so far in this process: (on AMX tiles, scores and P V on AMX tiles
    with the softmax on vector registers, on vector registers, items of the second kind whose
    P V was redone on vector registers)."""
    amx, tiles, vector, redone = torch.ops.attn_di.decode_items()
    return int(amx), int(tiles), int(vector), int(redone)


_SINKS = torch.randn(16, generator=torch.Generator().manual_seed(0))

# name: ((options, query_lens, seq_lens, block_size, layout), the paths its items take).
CASES = {
    # 4 and 16 query rows per KV head, one column chunk; 16 tokens over 4 chunks of 16; the
    # one-token sequence (4 heads per KV head) on tile_scores
    "gqa4-spec": (
        (Options(8, 2, 128), [4, 1, 16, 2], [300, 97, 1000, 16], 16, "declared"),
        {"amx", "tiles", "vector"},  # the 16-key sequence: too few keys for the tiles
    ),
    # one KV head of 8 query heads (the one-token sequence on tile_scores, C tiles 8 columns
    # wide), windowed, soft cap, ALiBi, sinks; block 24: tiles straddle
    "mqa8-options": (
        (
            Options(
                8,
                1,
                64,
                sliding_window=40,
                logits_soft_cap=20.0,
                alibi_slopes=[2.0 ** -(h + 1) for h in range(8)],
                sinks=_SINKS[:8],
            ),
            [1, 3, 2],
            [129, 70, 2],
            24,
            "declared",
        ),
        {"amx", "tiles", "vector"},  # the two-key sequence on vector registers
    ),
    # three tiles of 32 (D = 96), block size 1: every key tile gathered
    "d96-block1": (
        (Options(12, 2, 96), [2, 2, 1, 2], [2, 5, 33, 130], 1, "declared"),
        {"amx", "tiles", "vector"},  # 2 and 5 keys: vector registers; 33: the tiles
    ),
    # D = 256 (eight tiles of 32), vLLM's head-major page layout
    "d256-vllm-pages": (
        (Options(4, 2, 256), [2, 1], [513, 64], 32, "vllm-LBHNC"),
        {"amx", "tiles"},
    ),
    # 16 x 16 = 256 query rows of one KV head: 16 column chunks, four C tiles at a time; the
    # one-token sequence of 16 heads per KV head (A tiles of 16 rows) on tile_scores
    "d32-many-chunks": (
        (Options(16, 1, 32, sinks=_SINKS), [16, 1], [100, 300], 16, "head-major"),
        {"amx", "tiles"},
    ),
    # SmolLM2's decode (3 query heads per KV head of D = 64)
    "smollm2-decode": ((Options(9, 3, 64), [1, 1], [560, 33], 32, "declared"), {"tiles"}),
    # every layer option on tile_scores; block 24: tiles straddle; the last tile partial
    "tiles-options": (
        (
            Options(
                6,
                2,
                64,
                sliding_window=40,
                logits_soft_cap=20.0,
                alibi_slopes=[2.0 ** -(h + 1) for h in range(6)],
                sinks=_SINKS[:6],
            ),
            [1, 1, 1],
            [129, 70, 2],
            24,
            "declared",
        ),
        {"tiles", "vector"},  # the two-key sequence on vector registers
    ),
    # one query head per KV head (C tiles one column wide), five KV heads (a group of four C
    # tiles and one of one), block size 1: every key tile gathered
    "tiles-mha-block1": ((Options(5, 5, 32), [1, 1], [33, 100], 1, "vllm-LBHNC"), {"tiles"}),
    # 4 query heads of D = 128 per KV head, head-major blocks; sequences of 17 keys and one
    # key (fewer than 33: vector registers)
    "tiles-g4-head-major": (
        (Options(8, 2, 128), [1, 1, 1], [300, 17, 1], 16, "head-major"),
        {"tiles", "vector"},
    ),
    # 2 query heads per KV head (the C tiles two columns wide); the last 16 keys of both
    # sequences partial
    "tiles-g2": ((Options(4, 2, 64), [1, 1], [77, 40], 16, "head-major"), {"tiles"}),
    # 8 query heads per KV head: both parities of P in one A tile of 16 rows; D = 160 takes a
    # pass of 128 values of D and one of 32
    "tiles-g8-d160": ((Options(8, 1, 160), [1, 1], [100, 47], 16, "declared"), {"tiles"}),
    # 9 query heads per KV head: the parities in two A tiles; D = 96 takes a pass of 64 values
    # and one of 32
    "tiles-g9-d96": ((Options(18, 2, 96), [1, 1], [90, 40], 16, "head-major"), {"tiles"}),
    # a two-token sequence of few rows beside one-token ones: vector registers for it
    "tiles-mixed": (
        (Options(9, 3, 64), [1, 2, 1], [300, 50, 17], 32, "declared"),
        {"tiles", "vector"},
    ),
    # D no multiple of 32, and few query rows of a small D in a multi-token query: vector
    "d80": ((Options(8, 1, 80), [1, 4], [200, 64], 16, "declared"), {"vector"}),
    "spec-small": ((Options(9, 3, 64), [2, 2], [100, 64], 16, "declared"), {"vector"}),
}


def _run(
    case: tuple[Options, list[int], list[int], int, str], kernel_calls: list[int]
) -> dict[str, int]:
    """Run the case's bfloat16 batch through CPU_ATTN; assert it matches the reference
    (kernel and pure torch); return how many decode items each path took."""
    opts, query_lens, seq_lens, block_size, layout = case
    batch = make_batch(opts, query_lens, seq_lens, block_size, torch.bfloat16, layout=layout)
    before = _decode_items()
    kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, block_size)
    after = _decode_items()
    expected = reference_attention(opts, batch)
    assert_matches(kernel_out, expected, torch.bfloat16)
    assert_matches(torch_out, expected, torch.bfloat16)
    assert after[3] == before[3]  # finite inputs: tile_values never hands an item back
    return {path: a - b for path, a, b in zip(PATHS, after[:3], before[:3], strict=True)}


@requires_kernel
@requires_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_paths_match_reference(name: str, threads: int, kernel_calls: list[int]) -> None:
    """Each batch's items take the paths its shapes call for (items of at least 33 keys:
    tile_scores and tile_values for one-token items of <= 16 query heads per KV head and D a
    multiple of 32, else run_item_amx where query rows per KV head x D >= 512; vector
    registers otherwise), and match the float64 reference."""
    case, paths = CASES[name]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        taken = _run(case, kernel_calls)
    finally:
        torch.set_num_threads(previous)
    assert {path for path, count in taken.items() if count > 0} == paths, taken


@requires_kernel
@requires_amx
def test_float32_and_float16_never_take_the_tiles(kernel_calls: list[int]) -> None:
    """The tiles multiply bfloat16 only: float32 and float16 caches of an AMX-sized batch run
    on vector registers."""
    (opts, query_lens, seq_lens, block_size, _), _ = CASES["gqa4-spec"]
    for dtype in (torch.float32, torch.float16):
        batch = make_batch(opts, query_lens, seq_lens, block_size, dtype)
        before = _decode_items()
        kernel_out, _ = run_both_paths(opts, batch, kernel_calls, block_size)
        after = _decode_items()
        assert_matches(kernel_out, reference_attention(opts, batch), dtype)
        assert after[0] == before[0]
        assert after[1] == before[1]
        assert after[2] > before[2]


@requires_kernel
@requires_amx
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("group", [4, 12], ids=["one-a-tile", "two-a-tiles"])
def test_a_non_finite_value_on_the_tiles_stays_in_its_column(
    bad: float, group: int, kernel_calls: list[int]
) -> None:
    """A non-finite element in column 5 of one value row (KV head 0) of a one-token item: the
    float64 reference makes column 5 of that KV head's rows non-finite and leaves column 4
    finite. tile_values would spread it into column 4 (the zero beside each probability in an
    A tile times Inf or NaN is NaN), so it hands the item back and the vector registers redo
    P V: the output matches the reference value for value, and the kernel says it redid it.
    With 4 query heads per KV head both parities of P share one A tile, with 12 they take two."""
    opts = Options(2 * group, 2, 64)
    batch = make_batch(opts, [1, 1], [40, 70], 16, torch.bfloat16)
    batch.value[0, 0, 5] = bad  # sequence 0's new token (position 39), KV head 0
    batch.full_values[0][39, 0, 5] = bad
    expected = reference_attention(opts, batch)
    heads = expected[0].view(2 * group, 64)  # sequence 0's token: its heads' output rows
    assert not bool(torch.isfinite(heads[:group, 5]).any())
    assert bool(torch.isfinite(heads[:group, 4]).all())

    before = _decode_items()
    kernel_out, _ = run_both_paths(opts, batch, kernel_calls, 16)
    after = _decode_items()

    assert after[1] - before[1] == 2  # both one-token items on the tiles
    assert after[0] == before[0]
    assert after[2] == before[2]
    assert after[3] - before[3] == 1  # sequence 0's item, not sequence 1's
    assert torch.equal(kernel_out.isnan(), expected.isnan())
    tol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(kernel_out.double(), expected, atol=tol, rtol=tol, equal_nan=True)


# name: ((options, query_lens, seq_lens, block_size), dtype, the prefill path its items take:
# 0 AMX tiles, 1 oneDNN's reduced-precision GEMMs, 2 float32 GEMMs; None: 1 or 2, the CPU's).
PREFILL_CASES = {
    # every option; a chunked prefill over 700 keys (key ranges merged on two threads) and a
    # prefill of 40; block 24: key tiles straddle blocks
    "options": (
        (
            Options(
                8,
                2,
                64,
                sliding_window=100,
                logits_soft_cap=20.0,
                alibi_slopes=[2.0 ** -(h + 1) for h in range(8)],
                sinks=_SINKS[:8],
            ),
            [300, 40],
            [700, 40],
            24,
        ),
        torch.bfloat16,
        0,
    ),
    # SmolLM2's heads: 3 query rows per token, so row blocks end off the 32-row tiles (17 x 3)
    "rows-off-tiles": ((Options(9, 3, 64), [17, 61], [17, 200], 16), torch.bfloat16, 0),
    # D = 32 (one chunk), 96 (three), 160 (five) and 256; block size 1: every row gathered
    "d32": ((Options(4, 4, 32), [100], [129], 1), torch.bfloat16, 0),
    "d96": ((Options(6, 2, 96), [33, 20], [300, 20], 16), torch.bfloat16, 0),
    "d160": ((Options(4, 1, 160), [70], [70], 32), torch.bfloat16, 0),
    "d256": ((Options(2, 1, 256), [257], [600], 128), torch.bfloat16, 0),
    # D = 80, no multiple of 32: oneDNN's GEMMs
    "d80": ((Options(4, 2, 80), [50], [90], 16), torch.bfloat16, 1),
    # float32 never takes the tiles, float16 neither (oneDNN's or float32 GEMMs, by the CPU)
    "float32": ((Options(8, 2, 64), [40], [100], 16), torch.float32, 2),
    "float16": ((Options(8, 2, 64), [40], [100], 16), torch.float16, None),
}


@requires_kernel
@requires_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_paths_match_reference(name: str, threads: int, kernel_calls: list[int]) -> None:
    """Each prefill batch's items take the GEMMs its dtype and head size call for (AMX tiles
    written here for bfloat16 of D a multiple of 32) and match the float64 reference, on
    caches whose unused slots hold NaN and Inf."""
    (opts, query_lens, seq_lens, block_size), dtype, path = PREFILL_CASES[name]
    batch = make_batch(opts, query_lens, seq_lens, block_size, dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = [int(x) for x in torch.ops.attn_di.prefill_items()]
        kernel_out, torch_out = run_both_paths(opts, batch, kernel_calls, block_size)
        after = [int(x) for x in torch.ops.attn_di.prefill_items()]
    finally:
        torch.set_num_threads(previous)
    expected = reference_attention(opts, batch)
    assert_matches(kernel_out, expected, dtype)
    assert_matches(torch_out, expected, dtype)
    taken = {p for p in range(3) if after[p] > before[p]}
    if path is None:
        assert taken in ({1}, {2}), taken
    else:
        assert taken == {path}, taken


@requires_kernel
@requires_amx
@pytest.mark.parametrize("scale", [128**-0.5, 3.0, 1e-3], ids=["1/sqrt(128)", "3", "1e-3"])
@pytest.mark.parametrize("shared", [0.0, 8.0], ids=["plain", "shared-component"])
def test_scores_scaled_in_the_softmax_match_scaled_scores(scale: float, shared: float) -> None:
    """Without a soft cap or ALiBi, tile_scores leaves the scale to the softmax, which takes
    exp((s - max) * scale) (one pass over the scores fewer). The result is the scaled path's
    (forced here by ALiBi slopes of zero, which add exactly nothing) and the float64
    reference's, for a scale that is no power of two, a large and a small one, and keys that
    share a large component (every score far from zero, the softmax of their differences).
    Two sequences, one long enough to be split into items merged afterwards, NaN in every
    slot no sequence covers."""
    heads, kv_heads, size, block = 8, 2, 128, 16
    seq_lens = [300, 2100]
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, heads, size, generator=generator)
    common = torch.randn(kv_heads, size, generator=generator) * shared
    keys = [torch.randn(n, kv_heads, size, generator=generator) + common for n in seq_lens]
    values = [torch.randn(n, kv_heads, size, generator=generator) for n in seq_lens]
    query, keys, values = (
        query.bfloat16(),
        [k.bfloat16() for k in keys],
        [v.bfloat16() for v in values],
    )
    blocks = [(n + block - 1) // block for n in seq_lens]
    key_cache = torch.full((sum(blocks) + 3, block, kv_heads, size), math.nan, dtype=torch.bfloat16)
    value_cache = torch.full_like(key_cache, math.inf)
    order = torch.randperm(key_cache.shape[0], generator=generator)
    table = torch.zeros(2, max(blocks), dtype=torch.int32)
    first = 0
    for b, n in enumerate(seq_lens):
        table[b, : blocks[b]] = order[first : first + blocks[b]].int()
        first += blocks[b]
        for pos in range(n):
            slot_block, offset = int(table[b, pos // block]), pos % block
            key_cache[slot_block, offset] = keys[b][pos]
            value_cache[slot_block, offset] = values[b][pos]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)

    def run(alibi: torch.Tensor | None) -> torch.Tensor:
        out = torch.full_like(query, math.nan)
        torch.ops.attn_di.paged_attention(
            query, key_cache, value_cache, table, lens, starts, out, scale, 0, 0.0, alibi
        )
        return out

    before = _decode_items()
    deferred = run(None)
    assert _decode_items()[1] - before[1] >= 3  # on tile_scores: the long sequence split
    scaled = run(torch.zeros(heads))
    group = heads // kv_heads
    for b in range(2):
        k = keys[b].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = values[b].double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[b].double(), k) * scale, dim=-1)
        expected = torch.einsum("hn,nhd->hd", weights, v)
        assert_matches(deferred[b], expected, torch.bfloat16)
        assert_matches(scaled[b], expected, torch.bfloat16)
    tol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(deferred.double(), scaled.double(), atol=tol, rtol=tol)
