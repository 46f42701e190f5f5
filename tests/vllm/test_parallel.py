"""vLLM's parallel engines run attn_di's backend in every worker: TP=2, PP=2 (compiled), DP=2.

One engine per mode on a tiny random-weight Llama (4 query heads, 2 KV heads), two ranks
pinned to one core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: vLLM's ``auto`` binding wants a
NUMA node per rank). Every worker is asked, through ``collective_rpc``, which impl class its
attention layers built (equal tokens cannot tell two correct backends apart). TP and DP get
attn_di's backend from an override block entered with ``propagate=True`` and left before the
workers are asked (they keep what they were started with); PP from a registration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from vllm.entrypoints.llm import LLM
from vllm.inputs import TokensPrompt
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

import attn_di
from tests.vllm.conftest import CPU_ATTN_PATH, TOKEN_PROMPTS, tiny_settings, worker_impls

ATTN_DI_IMPL = "attn_di.integrations.vllm.backends.CPU_ATTNImpl"
NEW_TOKENS = 2


@pytest.fixture(autouse=True)
def _two_ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One CPU set per rank, functions sent to workers by value, registrations and
    propagated overrides written for the processes vLLM starts."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    before = attn_di.set_auto_propagation(True)
    yield
    attn_di.set_auto_propagation(before)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)


def _generate(llm: Any) -> list[int]:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in TOKEN_PROMPTS], _greedy())
    return [len(output.outputs[0].token_ids) for output in outputs]


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_workers_run_the_propagated_override(tiny_llama: Path) -> None:
    """TP=2: an override entered with propagate=True around the engine's start is what both
    worker processes built."""
    with attn_di.get_container().override(
        AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH, propagate=True
    ):
        llm = LLM(**tiny_settings(tiny_llama, tensor_parallel_size=2))
    try:
        assert llm.collective_rpc(worker_impls) == [(0, [ATTN_DI_IMPL]), (0, [ATTN_DI_IMPL])]
        assert _generate(llm) == [NEW_TOKENS] * len(TOKEN_PROMPTS)
    finally:
        _shutdown(llm)


def test_pipeline_parallel_workers_run_the_registration(tiny_llama: Path) -> None:
    """PP=2, compiled mode (vLLM 0.32's eager PP fails in vLLM itself): both stages, one
    layer each, built attn_di's impl from the driver's registration."""
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH)
    # compiled mode with torch.compile's "eager" backend: vLLM's compiled path (its warm-up
    # run allocates the stages' intermediate tensors) without inductor's C++ builds
    compiled = {"enforce_eager": False, "compilation_config": {"backend": "eager"}}
    llm = LLM(**tiny_settings(tiny_llama, pipeline_parallel_size=2, **compiled))
    try:
        assert llm.collective_rpc(worker_impls) == [(0, [ATTN_DI_IMPL]), (0, [ATTN_DI_IMPL])]
        assert _generate(llm) == [NEW_TOKENS] * len(TOKEN_PROMPTS)
    finally:
        _shutdown(llm)


def test_data_parallel_engines_run_the_propagated_override(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 through AsyncLLM (the server's path; vLLM refuses LLM(data_parallel_size=2)):
    the worker of each rank's engine core built attn_di's impl, and each rank generates."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")  # AsyncLLM: always multiprocess

    async def run() -> tuple[list[Any], list[int]]:
        args = AsyncEngineArgs(**tiny_settings(tiny_llama, data_parallel_size=2))
        with attn_di.get_container().override(
            AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH, propagate=True
        ):
            engine = AsyncLLM.from_engine_args(args)
        try:
            per_rank = await engine.engine_core.call_utility_all_async(
                "collective_rpc", worker_impls, None, (), None
            )
            lengths = []
            for rank in (0, 1):
                prompt = TokensPrompt(prompt_token_ids=TOKEN_PROMPTS[rank])
                outputs = [
                    output
                    async for output in engine.generate(
                        prompt, _greedy(), request_id=f"rank-{rank}", data_parallel_rank=rank
                    )
                ]
                lengths.append(len(outputs[-1].outputs[0].token_ids))
            return per_rank, lengths
        finally:
            engine.shutdown()

    per_rank, lengths = asyncio.run(run())
    workers = sorted(worker for rank in per_rank for worker in rank)
    assert workers == [(0, [ATTN_DI_IMPL]), (1, [ATTN_DI_IMPL])]
    assert lengths == [NEW_TOKENS, NEW_TOKENS]
