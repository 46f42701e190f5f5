"""vLLM's default multiprocess engine: registrations made in the driver reach its processes.

vLLM's CPU platform spawns the engine core and its worker; nothing is called there. The
driver's ``register_backend`` writes ``ATTN_DI_REGISTRATIONS`` (attn_di's automatic
propagation); in each spawned process vLLM loads its general plugins, attn_di's entry point
imports attn_di (which applies the variable) and installs the bridge, and vLLM's selector then
answers with attn_di's backend.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    register_backend,
)

import attn_di
from tests.vllm.conftest import (
    CPU_ATTN_PATH,
    TORCH_SDPA_PATH,
    attention_impls,
    engine,
    generate_tokens,
)

RUNS = {
    CPU_ATTN_PATH: "attn_di.integrations.vllm.backends.CPU_ATTNImpl runs "
    "attn_di.backends.cpu_attn.CPUAttentionBackend",
    TORCH_SDPA_PATH: "attn_di.integrations.vllm.backends.TORCH_SDPAImpl runs "
    "attn_di.backends.torch_sdpa.TorchSDPABackend",
}


@pytest.fixture(scope="module", autouse=True)
def _callables_to_workers() -> Iterator[None]:
    """Let ``llm.apply_model`` send a test function to vLLM's worker (pickled by name)."""
    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    yield
    if saved is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved


@pytest.fixture(scope="module", name="mp_reference_tokens")
def _mp_reference_tokens(smollm2: Path) -> list[list[int]]:
    """vLLM's own CPU_ATTN in the multiprocess engine (its worker runs one thread)."""
    with attn_di.use_container(), engine(smollm2, multiprocess=True) as llm:
        assert llm.apply_model(attention_impls) == [
            ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]
        ]
        return generate_tokens(llm)


@pytest.mark.parametrize("class_path", [CPU_ATTN_PATH, TORCH_SDPA_PATH], ids=["cpu_attn", "sdpa"])
def test_driver_registration_reaches_the_worker(
    smollm2: Path, mp_reference_tokens: list[list[int]], class_path: str
) -> None:
    """A registration in the driver (vLLM's register_backend, bridge installed) selects
    attn_di's backend in the spawned worker, which generates vLLM's own tokens."""
    before = attn_di.set_auto_propagation(True)
    try:
        with attn_di.use_container():
            register_backend(AttentionBackendEnum.CPU_ATTN, class_path)
            assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {"CPU_ATTN": class_path}
            with engine(smollm2, multiprocess=True) as llm:
                assert llm.apply_model(attention_impls) == [[RUNS[class_path]]]  # the worker
                assert generate_tokens(llm) == mp_reference_tokens
    finally:
        attn_di.set_auto_propagation(before)
