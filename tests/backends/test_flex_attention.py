"""FLEX_ATTENTION specifics: the eager warning is silenced precisely; compiled mode is opt-in."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as flex

from attn_di.backends.flex_attention import COMPILE_ENV_VAR, FlexAttentionImpl
from attn_di.exceptions import UnsupportedFeatureError
from tests.backends.reference import Options, make_batch, reference_attention


def test_eager_warning_does_not_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's "called without torch.compile" warning is filtered; others would still raise."""
    monkeypatch.setattr(flex, "_WARNINGS_SHOWN", set())
    opts = Options(num_heads=2, num_kv_heads=1, head_size=64)
    batch = make_batch(opts, [3], [3], 16, torch.float32)
    impl = FlexAttentionImpl(**opts.impl_kwargs())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    assert "flex_attention_performance" in flex._WARNINGS_SHOWN


def test_compiled_mode_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the environment variable impls run eagerly; with it they compile."""
    monkeypatch.delenv(COMPILE_ENV_VAR, raising=False)
    assert not FlexAttentionImpl(2, 64, 0.125).compiled

    monkeypatch.setenv(COMPILE_ENV_VAR, "1")
    assert FlexAttentionImpl(2, 64, 0.125).compiled


def test_compiled_mode_refuses_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled flex attention cannot return the log-sum-exp on CPU, so sinks are refused."""
    monkeypatch.setenv(COMPILE_ENV_VAR, "1")

    with pytest.raises(UnsupportedFeatureError, match="sinks in compiled mode"):
        FlexAttentionImpl(2, 64, 0.125, sinks=torch.zeros(2))


@pytest.mark.skipif(
    os.environ.get("ATTN_DI_TEST_FLEX_COMPILE") != "1",
    reason="compiling flex attention takes ~30 s on 2 CPU cores; "
    "set ATTN_DI_TEST_FLEX_COMPILE=1 to run it",
)
def test_compiled_mode_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch.compile path gives the reference result."""
    monkeypatch.setenv(COMPILE_ENV_VAR, "1")
    opts = Options(num_heads=4, num_kv_heads=2, head_size=64, logits_soft_cap=5.0)
    batch = make_batch(opts, [7, 1, 3], [7, 20, 12], 16, torch.float32)
    impl = FlexAttentionImpl(**opts.impl_kwargs())

    out = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)

    torch.testing.assert_close(out.double(), reference_attention(opts, batch), atol=1e-4, rtol=1e-4)
