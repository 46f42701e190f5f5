"""CPU_ATTN's decode kernel on AMX tiles (the ``amx`` build, bfloat16 caches).

The AMX path reads the paged cache in place: key rows straight into tiles where 16 of them
are one block's consecutive slots, gathered where not; value rows interleaved in pairs. These
cases cross each of its branches (column chunks of 16 query rows, one to more than four per
KV head; tiles inside a block, across blocks and past the item; head sizes of one to eight
tiles of 32; every layer option; every cache layout) against the float64 reference on caches
whose unused slots hold NaN and Inf, and ask the kernel which path ran
(``torch.ops.attn_di.decode_items``): equal outputs cannot tell the AMX path from the vector
path it replaces.
"""

from __future__ import annotations

import pytest
import torch

from attn_di.backends import _cpu_kernel
from tests.backends.reference import Options, make_batch, reference_attention
from tests.backends.test_cpu_kernel import assert_matches, requires_kernel, run_both_paths


def _amx_active() -> bool:
    status = _cpu_kernel.kernel_status()
    return status.active and status.isa == "amx" and "AMX tiles" in (status.bfloat16 or "")


requires_amx = pytest.mark.skipif("not _amx_active()", reason="needs the amx build on AMX")


def _decode_items() -> tuple[int, int]:
    """(items on AMX tiles, items on vector registers) run so far in this process."""
    amx, vector = torch.ops.attn_di.decode_items()
    return int(amx), int(vector)


# (options, query_lens, seq_lens, block_size, layout): each takes the AMX path for every item
# (query rows per KV head x head size >= 512).
AMX_CASES = {
    # 4 and 16 query rows per KV head, one column chunk; 16 tokens over 4 chunks of 16
    "gqa4-spec": (Options(8, 2, 128), [4, 1, 16, 2], [300, 97, 1000, 16], 16, "declared"),
    # one KV head of 8 query heads, windowed, soft cap, ALiBi, sinks; block 24: tiles straddle
    "mqa8-options": (
        Options(
            8,
            1,
            64,
            sliding_window=40,
            logits_soft_cap=20.0,
            alibi_slopes=[2.0 ** -(h + 1) for h in range(8)],
            sinks=torch.randn(8, generator=torch.Generator().manual_seed(0)),
        ),
        [1, 3, 2],
        [129, 70, 2],
        24,
        "declared",
    ),
    # three tiles of 32 (D = 96), block size 1: every key tile gathered
    "d96-block1": (Options(12, 2, 96), [2, 2, 1, 2], [2, 5, 33, 130], 1, "declared"),
    # D = 256 (eight tiles of 32), vLLM's head-major page layout
    "d256-vllm-pages": (Options(4, 2, 256), [1, 1], [513, 64], 32, "vllm-LBHNC"),
    # 16 x 16 = 256 query rows of one KV head: 16 column chunks, four C tiles at a time
    "d32-many-chunks": (
        Options(16, 1, 32, sinks=torch.randn(16, generator=torch.Generator().manual_seed(1))),
        [16, 1],
        [40, 300],
        16,
        "head-major",
    ),
}

# Cases the vector path keeps (D no multiple of 32; too little work per key for the tiles).
VECTOR_CASES = {
    "d80": (Options(8, 1, 80), [1, 4], [200, 64], 16, "declared"),
    "smollm2-decode": (Options(9, 3, 64), [1, 1], [560, 31], 32, "declared"),
}


def _run(
    case: tuple[Options, list[int], list[int], int, str], kernel_calls: list[int]
) -> tuple[int, int]:
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
    return after[0] - before[0], after[1] - before[1]


@requires_kernel
@requires_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(AMX_CASES))
def test_amx_decode_matches_reference(name: str, threads: int, kernel_calls: list[int]) -> None:
    """Every item of these batches runs on AMX tiles and matches the float64 reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        amx, vector = _run(AMX_CASES[name], kernel_calls)
    finally:
        torch.set_num_threads(previous)
    assert amx > 0
    assert vector == 0


@requires_kernel
@requires_amx
@pytest.mark.parametrize("name", list(VECTOR_CASES))
def test_vector_path_keeps_what_amx_does_not_take(name: str, kernel_calls: list[int]) -> None:
    """D not a multiple of 32, or few query rows per KV head of a small D, stay on the
    AVX512_BF16 dot products (said by kernel_status().bfloat16), and match the reference."""
    amx, vector = _run(VECTOR_CASES[name], kernel_calls)
    assert amx == 0
    assert vector > 0


@requires_kernel
@requires_amx
def test_float32_and_float16_never_take_the_tiles(kernel_calls: list[int]) -> None:
    """The tiles multiply bfloat16 only: float32 and float16 caches of an AMX-sized batch run
    on vector registers."""
    opts, query_lens, seq_lens, block_size, _ = AMX_CASES["gqa4-spec"]
    for dtype in (torch.float32, torch.float16):
        batch = make_batch(opts, query_lens, seq_lens, block_size, dtype)
        before = _decode_items()
        kernel_out, _ = run_both_paths(opts, batch, kernel_calls, block_size)
        after = _decode_items()
        assert_matches(kernel_out, reference_attention(opts, batch), dtype)
        assert after[0] == before[0]
        assert after[1] > before[1]
