"""The tiny_llm example: every CPU backend generates the float64 reference path's tokens."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from attn_di import AttentionBackendEnum, BackendContainer
from tests.backends.reference import DIRTY_FILLS, dirty_kv_cache

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_llm"
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [300]]
NEW_TOKENS = 6


@pytest.fixture(name="tiny_llm")
def _tiny_llm(monkeypatch: pytest.MonkeyPatch, container: BackendContainer) -> Iterator[ModuleType]:
    """The example's modules, importable, with the engine module wired to the test container."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    engine_module = importlib.import_module("llm_engine")
    container.wire(modules=[engine_module], warn_unresolved=True)
    yield engine_module
    container.unwire()


def _dirty_caches(engine: Any, fill: str = "nan") -> None:
    """Replace the engine's caches by ones whose every slot holds ``fill`` until written."""
    config = engine.config
    engine.kv_caches = [
        dirty_kv_cache(
            engine.backend_cls,
            config.num_blocks,
            config.block_size,
            config.num_kv_heads,
            config.head_size,
            config.torch_dtype,
            fill,
        )
        for _ in engine.kv_caches
    ]


@pytest.fixture(name="reference_tokens", scope="module")
def _reference_tokens() -> list[list[int]]:
    """Tokens of the float64 reference path (reference attention, float64 weights)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        llm_engine = importlib.import_module("llm_engine")
        model = importlib.import_module("model")
        reference = importlib.import_module("reference_backend")
        engine = llm_engine.Engine(
            model.ModelConfig(dtype="float64"), backend_cls=reference.ReferenceBackend
        )
        _dirty_caches(engine)
        tokens: list[list[int]] = engine.generate(PROMPTS, NEW_TOKENS).tokens
        return tokens
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.mark.parametrize("fill", DIRTY_FILLS)
@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"])
def test_every_cpu_backend_generates_the_reference_tokens(
    backend: str,
    fill: str,
    tiny_llm: ModuleType,
    container: BackendContainer,
    reference_tokens: list[list[int]],
) -> None:
    """Greedy tokens in float32 through each backend, on caches full of NaN or +-Inf outside the
    written slots, equal the float64 reference path's."""
    model = importlib.import_module("model")
    config = model.ModelConfig()
    tiny_llm.configure(container, config, backend=backend)
    engine = tiny_llm.Engine(config)
    _dirty_caches(engine, fill)
    assert engine.backend_cls.get_name() == backend
    result = engine.generate(PROMPTS, NEW_TOKENS)
    assert result.tokens == reference_tokens
    assert len(result.decode_s) == NEW_TOKENS - 1
    assert engine.allocator.num_free == config.num_blocks - 1  # every block given back


def test_override_reaches_the_engine_and_forward_runs_per_layer_per_step(
    tiny_llm: ModuleType, container: BackendContainer, mocker: Any
) -> None:
    """Overriding the selected member swaps the engine's backend; forward runs layers x steps."""
    from attn_di.backends.torch_sdpa import TorchSDPABackend

    model = importlib.import_module("model")
    config = model.ModelConfig()
    tiny_llm.configure(container, config)  # automatic: CPU_ATTN on the CPU
    impl_cls = TorchSDPABackend.get_impl_cls()
    spy = mocker.spy(impl_cls, "forward")
    with container.override(AttentionBackendEnum.CPU_ATTN, TorchSDPABackend):
        engine = tiny_llm.Engine(config)
        assert container.selection().backend is AttentionBackendEnum.CPU_ATTN
        engine.generate(PROMPTS, 4)
    assert engine.backend_cls is TorchSDPABackend
    assert spy.call_count == config.num_layers * 4
    first_call = spy.call_args_list[0]
    query = first_call.args[2]
    assert tuple(query.shape) == (sum(map(len, PROMPTS)), config.num_heads, config.head_size)
    assert tiny_llm.Engine(config).backend_cls.get_name() == "CPU_ATTN"


def test_generate_script() -> None:
    """generate.py prints the backend, the tokens per prompt, the check against the float64
    reference path (--check) and the per-token latency."""
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "generate.py"),
            "--backend",
            "auto",
            "--tokens",
            "4",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("backend: CPU_ATTN (attn_di.backends.cpu_attn.CPUAttentionBackend")
    assert sum(line.startswith("prompt ") for line in lines) == 3
    assert lines[-2] == (
        "check: the tokens equal the float64 reference path's (same weights in float64, "
        "attention by attn_di.reference): yes"
    )
    assert "ms per token" in lines[-1]


def test_generate_script_bad_backend() -> None:
    """An unknown --backend is one readable error line, exit 2."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "generate.py"), "--backend", "cpu_atn", "--tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "did you mean 'CPU_ATTN'" in result.stderr
