"""The paged KV cache holds each new token's key/value at its slot after forward."""

from __future__ import annotations

import pytest
import torch

from attn_di.backend import AttentionBackend, AttentionMetadataBuilder
from tests.backends.reference import (
    KV_LAYOUTS,
    Options,
    differs,
    make_batch,
    reference_attention,
    slot_index,
)


def test_new_tokens_land_in_their_slots(backend_cls: type[AttentionBackend]) -> None:
    """Every query token's key/value is in the cache at slot_mapping; other slots are unchanged."""
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [6, 1, 4], [6, 21, 35], 16, torch.float32)
    before = batch.kv_cache.clone()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    flat_after = batch.kv_cache.view(2, -1, 2, 64)
    flat_before = before.view(2, -1, 2, 64)
    slots = batch.metadata.slot_mapping
    assert torch.equal(flat_after[0][slots], batch.key)
    assert torch.equal(flat_after[1][slots], batch.value)
    untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not differs(flat_after[:, untouched], flat_before[:, untouched]).any()


def test_padding_slots_are_not_written(backend_cls: type[AttentionBackend]) -> None:
    """A token whose slot is -1 leaves the cache untouched, including its last slot."""
    opts = Options(num_heads=2, num_kv_heads=2, head_size=64)
    batch = make_batch(opts, [3], [3], 16, torch.float32)
    batch.metadata.slot_mapping[1] = -1
    before = batch.kv_cache.clone()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    changed = differs(batch.kv_cache, before).view(2, -1, 2 * 64).any(dim=-1).any(dim=0)
    slot_mapping = batch.metadata.slot_mapping
    assert changed.nonzero().flatten().tolist() == sorted(int(s) for s in slot_mapping if s >= 0)
    assert not changed[-1]


def test_padded_tokens_past_num_actual_tokens_are_ignored(
    backend_cls: type[AttentionBackend],
) -> None:
    """NaN rows beyond num_actual_tokens (slot -1) are neither cached nor attended."""
    opts = Options(num_heads=2, num_kv_heads=1, head_size=64)
    batch = make_batch(opts, [2, 1], [2, 5], 16, torch.float32, pad_tokens=2)
    md = batch.metadata
    before = batch.kv_cache.clone()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md)

    assert out.shape == (5, 2 * 64)
    changed = differs(batch.kv_cache, before).view(2, -1, 64).any(dim=-1).any(dim=0)
    assert changed.nonzero().flatten().tolist() == sorted(md.slot_mapping[:3].tolist())
    torch.testing.assert_close(
        out[:3].double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4
    )


def test_builder_computes_slots_from_the_block_table() -> None:
    """slot = block_table[i, pos // block_size] * block_size + pos % block_size, last positions."""
    builder = AttentionMetadataBuilder(block_size=4)

    metadata = builder.build([2, 1], [5, 9], [[7, 3, 0], [1, 2, 5]])

    assert metadata.slot_mapping.tolist() == [7 * 4 + 3, 3 * 4 + 0, 5 * 4 + 0]
    assert metadata.query_start_loc.tolist() == [0, 2, 3]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.dtype == torch.int32
    assert metadata.block_table.dtype == torch.int32
    assert metadata.slot_mapping.dtype == torch.int64
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.num_actual_tokens) == (2, 9, 3)


@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_caches_are_written_and_read_in_place(
    backend_cls: type[AttentionBackend], layout: str, dtype: torch.dtype
) -> None:
    """A cache in any memory layout (a permuted view of one NaN-filled buffer, as vLLM hands
    a layer) is written at exactly the new tokens' slots, through its strides, with no other
    byte of the buffer changed, and attended in place to the reference's result."""
    opts = Options(num_heads=6, num_kv_heads=2, head_size=40, sliding_window=30)
    batch = make_batch(opts, [6, 1, 4, 3], [6, 50, 35, 3], 16, dtype, layout=layout)
    buffer = batch.kv_cache
    while buffer._base is not None:  # the allocation itself, in memory order
        buffer = buffer._base
    before = buffer.clone()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    where = slot_index(batch.kv_cache, batch.metadata.slot_mapping)
    assert torch.equal(batch.kv_cache[0][where], batch.key)
    assert torch.equal(batch.kv_cache[1][where], batch.value)
    assert int(differs(buffer, before).sum()) == 2 * 14 * 2 * 40  # 14 tokens, K and V, 2 heads
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=tol, rtol=tol)
