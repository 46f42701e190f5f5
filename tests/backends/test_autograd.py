"""Backends that declare backward support give the reference gradients."""

from __future__ import annotations

import pytest
import torch

from attn_di.backend import AttentionBackend
from tests.backends.reference import Options, make_batch, reference_attention


def test_declared_backward_matches_reference(backend_cls: type[AttentionBackend]) -> None:
    """d(sum(out * w))/d(query) equals the float64 reference's; key/value get gradients."""
    if not backend_cls.supports_backward:
        pytest.skip(f"{backend_cls.get_name()} declares no backward support")
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, sliding_window=6)
    batch = make_batch(opts, [5, 1, 2], [5, 9, 12], 16, torch.float32)
    weights = torch.randn(8, 4 * 64, dtype=torch.float64)
    query_ref = batch.query.double().requires_grad_()
    ref_batch = make_batch(opts, [5, 1, 2], [5, 9, 12], 16, torch.float32)
    ref_batch.query = query_ref
    (reference_attention(opts, ref_batch) * weights).sum().backward()
    query = batch.query.clone().requires_grad_()
    key = batch.key.clone().requires_grad_()
    value = batch.value.clone().requires_grad_()
    impl = backend_cls.get_impl_cls()(**opts.impl_kwargs())

    out = impl.forward(None, query, key, value, batch.kv_cache, batch.metadata)
    (out.double() * weights).sum().backward()

    assert query.grad is not None
    assert key.grad is not None
    assert value.grad is not None
    torch.testing.assert_close(query.grad.double(), query_ref.grad, atol=1e-4, rtol=1e-4)
    assert bool(torch.isfinite(key.grad).all())
    assert bool(value.grad.abs().sum() > 0)
