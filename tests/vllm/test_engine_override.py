"""A live vLLM engine's backend swapped with ``attn_di.get_container().override(...)``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from pytest_mock import MockerFixture
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import attn_di
from attn_di.integrations.vllm.backends import CPU_ATTN, AttnDIImpl
from tests.vllm.conftest import engine, generate_tokens, layer_impls, remember_reference


class Spy(CPU_ATTN):
    """A vLLM backend wrapping attn_di's CPU_ATTN; the test counts its impl's forward calls."""


def test_override_swaps_the_backend_of_a_live_engine(smollm2: Path, mocker: MockerFixture) -> None:
    """Inside the block vLLM builds its layers with Spy and generates vLLM's own tokens through
    it; an engine built after the block uses vLLM's default CPU_ATTN again."""
    forward = mocker.spy(Spy.impl_cls, "forward")
    container = attn_di.get_container()
    with container.override(AttentionBackendEnum.CPU_ATTN, Spy), engine(smollm2) as llm:
        impls = layer_impls(llm)
        assert {type(impl) for impl in impls} == {Spy.impl_cls}
        assert all(isinstance(impl, AttnDIImpl) for impl in impls)
        assert {impl.attn_di_backend.__module__ for impl in impls} == {"attn_di.backends.cpu_attn"}
        spied_tokens = generate_tokens(llm)
        assert forward.call_count >= len(impls) * 32  # every layer, every step
    calls = forward.call_count
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    with engine(smollm2) as llm:
        assert {type(impl).__module__ for impl in layer_impls(llm)} == {
            "vllm.v1.attention.backends.cpu_attn"
        }
        default_tokens = generate_tokens(llm)
    remember_reference("float32", default_tokens)
    assert forward.call_count == calls
    assert spied_tokens == default_tokens
