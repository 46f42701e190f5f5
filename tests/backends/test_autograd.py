"""Backends that declare backward support give the reference gradients, on dirty caches too."""

from __future__ import annotations

import pytest
import torch

from attn_di.backend import AttentionBackend
from tests.backends.reference import DIRTY_FILLS, Batch, Options, make_batch, reference_attention

QUERY_LENS, SEQ_LENS = [5, 1, 2, 1], [5, 9, 12, 30]


def _gradients(
    backend_cls: type[AttentionBackend], opts: Options, batch: Batch, weights: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of ``sum(out * weights)`` with respect to query, key and value."""
    query, key, value = (t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value))
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())
    out = impl.forward(None, query, key, value, batch.kv_cache, batch.metadata)
    (out.double() * weights).sum().backward()
    grads = [t.grad for t in (query, key, value)]
    assert all(grad is not None for grad in grads)
    return [grad for grad in grads if grad is not None]


@pytest.mark.parametrize("fill", DIRTY_FILLS)
@pytest.mark.parametrize(
    "opts",
    [
        Options(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=6),
        Options(num_heads=4, num_kv_heads=2, head_size=64, logits_soft_cap=8.0),
        Options(num_heads=4, num_kv_heads=2, head_size=64, sinks=torch.randn(4)),
    ],
    ids=["sliding-window", "soft-cap", "sinks"],
)
def test_declared_backward_matches_reference(
    backend_cls: type[AttentionBackend], opts: Options, fill: str
) -> None:
    """d(sum(out * w))/d(query) equals the float64 reference's; dirty slots change no gradient."""
    if not backend_cls.supports_backward:
        pytest.skip(f"{backend_cls.get_name()} declares no backward support")
    if opts.logits_soft_cap is not None and backend_cls.get_name() == "TORCH_SDPA":
        pytest.skip("TORCH_SDPA refuses a soft cap")
    weights = torch.randn(sum(QUERY_LENS), 4 * 64, dtype=torch.float64)
    ref_batch = make_batch(opts, QUERY_LENS, SEQ_LENS, 16, torch.float32)
    query_ref = ref_batch.query.double().requires_grad_()
    ref_batch.query = query_ref
    (reference_attention(opts, ref_batch) * weights).sum().backward()
    batches = [
        make_batch(opts, QUERY_LENS, SEQ_LENS, 16, torch.float32, fill=f, backend_cls=backend_cls)
        for f in (fill, "zero")
    ]

    dirty, clean = (_gradients(backend_cls, opts, batch, weights) for batch in batches)

    assert query_ref.grad is not None
    torch.testing.assert_close(dirty[0].double(), query_ref.grad, atol=1e-4, rtol=1e-4)
    for dirty_grad, clean_grad in zip(dirty, clean, strict=True):
        assert bool(dirty_grad.isfinite().all())
        torch.testing.assert_close(dirty_grad, clean_grad, atol=0, rtol=0)
    assert bool(dirty[2].abs().sum() > 0)


@pytest.mark.parametrize("fill", DIRTY_FILLS)
def test_bfloat16_backward_ignores_dirty_slots(
    backend_cls: type[AttentionBackend], fill: str
) -> None:
    """In bfloat16 the gradients on a NaN/Inf cache are finite and equal the zero cache's."""
    if not backend_cls.supports_backward:
        pytest.skip(f"{backend_cls.get_name()} declares no backward support")
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, alibi_slopes=[0.5, 0.25, 0.1, 0.05])
    weights = torch.randn(sum(QUERY_LENS), 4 * 64, dtype=torch.float64)
    batches = [
        make_batch(opts, QUERY_LENS, SEQ_LENS, 16, torch.bfloat16, fill=f, backend_cls=backend_cls)
        for f in (fill, "zero")
    ]

    dirty, clean = (_gradients(backend_cls, opts, batch, weights) for batch in batches)

    for dirty_grad, clean_grad in zip(dirty, clean, strict=True):
        assert bool(dirty_grad.isfinite().all())
        torch.testing.assert_close(dirty_grad, clean_grad, atol=0, rtol=0)
