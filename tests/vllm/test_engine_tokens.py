"""attn_di's backends inside vLLM's in-process engine generate vLLM's own tokens.

vLLM's CPU platform always asks for CPU_ATTN; registering one of attn_di's vLLM backends for it
is the one line that selects it. The engines use vLLM's CPU defaults (block size 128, chunked
prefill and prefix caching on).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    register_backend,
)

import attn_di
from attn_di.integrations.vllm.backends import AttnDIImpl
from tests.vllm.conftest import (
    CPU_ATTN_PATH,
    TORCH_SDPA_PATH,
    chat,
    engine,
    generate_tokens,
    greedy,
    layer_impls,
)


@pytest.fixture(scope="module", name="cpu_attn_engine")
def _cpu_attn_engine(smollm2: Path) -> Iterator[Any]:
    """An in-process engine with attn_di's CPU_ATTN registered through vLLM's API."""
    with attn_di.use_container():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH)
        with engine(smollm2) as llm:
            yield llm


def test_cpu_attn_generates_vllm_tokens(
    cpu_attn_engine: Any, vllm_reference_tokens: list[list[int]]
) -> None:
    """Greedy tokens of 7 chat prompts x 32 equal those of vLLM's own CPU_ATTN."""
    impls = layer_impls(cpu_attn_engine)
    assert all(isinstance(impl, AttnDIImpl) for impl in impls)
    assert {impl.attn_di_backend.get_name() for impl in impls} == {"CPU_ATTN"}
    assert generate_tokens(cpu_attn_engine) == vllm_reference_tokens


def test_prefix_cache_hits_give_the_same_tokens(cpu_attn_engine: Any) -> None:
    """A prompt longer than a block (128) generated twice: the second run reads the first's
    cached blocks (vLLM's prefix cache, blocks of the shared buffer) and gives the same tokens."""
    long_prompt = "Summarize: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))
    first = cpu_attn_engine.chat([chat(long_prompt)], greedy(), use_tqdm=False)[0]
    second = cpu_attn_engine.chat([chat(long_prompt)], greedy(), use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 256
    assert (second.num_cached_tokens or 0) >= 128
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_torch_sdpa_generates_vllm_tokens(
    smollm2: Path, vllm_reference_tokens: list[list[int]]
) -> None:
    """attn_di's TORCH_SDPA, registered with attn_di's own register_backend, gives the same."""
    with attn_di.use_container():
        attn_di.register_backend(attn_di.AttentionBackendEnum.CPU_ATTN, TORCH_SDPA_PATH)
        with engine(smollm2) as llm:
            impls = layer_impls(llm)
            assert {impl.attn_di_backend.get_name() for impl in impls} == {"TORCH_SDPA"}
            assert generate_tokens(llm) == vllm_reference_tokens
