"""attn_di.reference: the feature-complete float64 reference, as the backend tests define it."""

from __future__ import annotations

import pytest
import torch

from attn_di.reference import reference_attention, sequence_attention
from tests.backends import reference as test_reference

OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 5},
    "softcap": {"logits_soft_cap": 1.5},
    "alibi": {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "all": {
        "sliding_window": 7,
        "logits_soft_cap": 2.0,
        "alibi_slopes": [0.5, 0.25, 0.125, 0.0625],
        "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0]),
    },
}


@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "encoder_only"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_reference_matches_the_backend_tests_definition(name: str, encoder: bool) -> None:
    """Over a dirty paged cache (NaN outside the written slots), with each option and all of
    them: the public reference equals tests/backends/reference.py's, to float64 rounding."""
    options = OPTIONS[name]
    opts = test_reference.Options(
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        sliding_window=options.get("sliding_window"),
        logits_soft_cap=options.get("logits_soft_cap"),
        alibi_slopes=options.get("alibi_slopes"),
        sinks=options.get("sinks"),
        encoder_only=encoder,
    )
    batch = test_reference.make_batch(opts, [5, 1, 3], [9, 12, 3], 4, torch.float32, seed=3)
    expected = test_reference.reference_attention(opts, batch)
    got = reference_attention(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, opts.scale, **options
    )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_without_options_it_is_causal_softmax_attention() -> None:
    """The behaviour callers had: causal softmax(q k^T * scale) v over the cache and the new
    tokens, float64 out."""
    opts = test_reference.Options(num_heads=2, num_kv_heads=1, head_size=8)
    batch = test_reference.make_batch(opts, [3], [6], 2, torch.float32, seed=1)
    got = reference_attention(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, opts.scale
    )
    keys = batch.full_keys[0].repeat_interleave(2, dim=1)
    values = batch.full_values[0].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", batch.query.double(), keys) * opts.scale
    hidden = torch.arange(6)[None, :] > torch.arange(3, 6)[:, None]
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    want = torch.einsum("hqk,khd->qhd", weights, values).reshape(3, 16)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sequence_attention_computes_naively_in_a_model_dtype(dtype: torch.dtype) -> None:
    """dtype=: the same attention with every step in that dtype; its error against float64
    is of the dtype's order, not zero and not more."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 16, generator=generator)
    keys = torch.randn(40, 2, 16, generator=generator)
    values = torch.randn(40, 2, 16, generator=generator)
    exact = sequence_attention(query, keys, values, 0.25, sliding_window=9, logits_soft_cap=2.0)
    naive = sequence_attention(
        query, keys, values, 0.25, sliding_window=9, logits_soft_cap=2.0, dtype=dtype
    )
    assert naive.dtype == dtype
    error = float((naive.double() - exact).abs().max())
    eps = torch.finfo(dtype).eps
    assert 0 < error < 64 * eps
