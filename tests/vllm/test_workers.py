"""What this process announces is what vLLM's other processes run, or the engine is refused
here, before any of them starts.

An override block holds only in the process that entered it; vLLM's TP/PP workers (other
processes even with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its multiprocess engine core
would run vLLM's own backend under it. So would every process of an engine whose
``VLLM_PLUGINS`` leaves attn_di's plugin out. Each is refused with
``BackendNotPropagatedError`` (the propagated override that does reach them is in
test_parallel.py). Ray (which vLLM's CPU build refuses) at the unit level: the prefix
vLLM's Ray executor copies, and ``ray_runtime_env()`` after vLLM's own ``register_backend``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import vllm.envs as envs
from vllm.entrypoints.llm import LLM
from vllm.v1.attention.backends import registry
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

import attn_di
from attn_di.exceptions import BackendNotPropagatedError
from attn_di.integrations import vllm as bridge
from tests.vllm.conftest import CPU_ATTN_PATH, TORCH_SDPA_PATH, tiny_settings

RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
VLLM_OWN = "vLLM's own vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@pytest.fixture(autouse=True)
def _engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Automatic propagation on (as for a user); nothing started by a test outlives it."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    before = attn_di.set_auto_propagation(True)
    children = set(multiprocessing.active_children())
    yield
    attn_di.set_auto_propagation(before)
    assert set(multiprocessing.active_children()) <= children  # refused before any started


def _refused(model: Path, **options: object) -> BackendNotPropagatedError:
    with pytest.raises(BackendNotPropagatedError) as caught:
        LLM(**tiny_settings(model, **options))
    return caught.value


def test_an_override_block_at_tp2_is_refused_before_the_workers_start(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 with the engine core in this process: the two workers are still other processes,
    where the block does not hold."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with attn_di.get_container().override(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH):
        error = _refused(tiny_llama, tensor_parallel_size=2)
    assert isinstance(error, RuntimeError)
    assert (error.member, error.class_path, error.source) == ("CPU_ATTN", CPU_ATTN_PATH, "override")
    assert error.processes == "the 2 worker processes of tensor_parallel_size=2"
    assert error.elsewhere == VLLM_OWN
    assert str(error).startswith(
        f"CPU_ATTN resolves to {CPU_ATTN_PATH} here (override), but the 2 worker processes of "
        "tensor_parallel_size=2 would not see it: an override block holds only in the process "
        "that entered it"
    )
    assert "Hint: register it instead" in str(error)
    assert "override(CPU_ATTN, ..., propagate=True)" in str(error)


def test_an_override_block_around_the_multiprocess_engine_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank, vLLM's default multiprocess engine: its worker is another process (on CPU
    vLLM's mp executor); AsyncLLM (the server's path) with VLLM_ENABLE_V1_MULTIPROCESSING=0
    keeps the worker in the engine core, which is itself another process."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with attn_di.get_container().override(AttentionBackendEnum.CPU_ATTN, TORCH_SDPA_PATH):
        worker = _refused(tiny_llama)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with pytest.raises(BackendNotPropagatedError) as caught:
            AsyncLLM.from_engine_args(AsyncEngineArgs(**tiny_settings(tiny_llama)))
    assert worker.processes == (
        "the worker process of vLLM's mp executor (distributed_executor_backend='mp')"
    )
    engine_core = caught.value
    assert engine_core.processes.startswith("vLLM's engine core process (the multiprocess")
    assert (worker.source, engine_core.source) == ("override", "override")


@pytest.mark.parametrize(
    ("variable", "value", "reason", "hint"),
    [
        (
            "VLLM_PLUGINS",
            "other_plugin",
            "VLLM_PLUGINS='other_plugin' does not name attn_di",
            "add attn_di to the list (VLLM_PLUGINS=attn_di,other_plugin)",
        ),
        (
            "ATTN_DI_VLLM_BRIDGE",
            "0",
            "ATTN_DI_VLLM_BRIDGE='0' keeps attn_di's plugin from installing the bridge",
            "unset ATTN_DI_VLLM_BRIDGE (or set it to 1)",
        ),
    ],
    ids=["vllm_plugins", "bridge_off"],
)
def test_a_registration_the_bridge_cannot_carry_is_refused(
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    reason: str,
    hint: str,
) -> None:
    """The bridge installed here by hand, but vLLM's processes will not install it: even a
    registration (in ATTN_DI_REGISTRATIONS) would not be used there."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv(variable, value)
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH)
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {"CPU_ATTN": CPU_ATTN_PATH}
    error = _refused(tiny_llama)
    assert error.source == "registered"
    assert error.reason.startswith(reason)
    assert error.elsewhere == VLLM_OWN
    assert f"Hint: {hint}" in str(error)


def test_an_override_block_around_a_data_parallel_engine_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 through AsyncLLM: refused when the engine configuration is made, before the
    engine cores start."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    args = AsyncEngineArgs(**tiny_settings(tiny_llama, data_parallel_size=2))
    with (
        attn_di.get_container().override(AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH),
        pytest.raises(BackendNotPropagatedError) as caught,
    ):
        AsyncLLM.from_engine_args(args)
    assert caught.value.processes.startswith("the 2 engine core processes of data_parallel_size=2")


@pytest.mark.parametrize(
    ("sizes", "executor", "processes"),
    [
        ((1, 1, 1), "uni", None),
        ((2, 1, 1), "mp", "the 2 worker processes of tensor_parallel_size=2"),
        (
            (2, 2, 1),
            "mp",
            "the 4 worker processes of tensor_parallel_size=2, pipeline_parallel_size=2",
        ),
        (
            (1, 1, 2),
            "uni",
            "the 2 engine core processes of data_parallel_size=2",
        ),
        ((2, 1, 1), "external_launcher", None),  # each rank is a process the user started
        ((2, 1, 1), object, None),  # an executor class of the user's: not judged
    ],
)
def test_the_processes_that_run_attention_are_named(
    sizes: tuple[int, int, int], executor: object, processes: str | None
) -> None:
    """Which processes other than the engine core run attention, from the parallel config."""
    from attn_di.integrations.vllm._workers import processes_elsewhere

    tensor, pipeline, data = sizes
    parallel = SimpleNamespace(
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
        data_parallel_size=data,
        distributed_executor_backend=executor,
    )
    assert processes_elsewhere(SimpleNamespace(parallel_config=parallel)) == processes


@pytest.fixture(name="fresh_envs")
def _fresh_envs() -> Iterator[None]:
    """vLLM's environment reads uncached (an engine start in this process caches them)."""
    cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    yield
    if cached:
        envs.enable_envs_cache()


@pytest.mark.usefixtures("fresh_envs")
def test_the_bridge_adds_attn_di_to_vllms_ray_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's older Ray executor copies ATTN_DI_REGISTRATIONS once the bridge is installed;
    the user's own prefixes stay, and uninstall() removes only attn_di's."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    bridge.uninstall()
    try:
        monkeypatch.setenv(RAY_PREFIXES, "MY_APP_")
        monkeypatch.setenv("ATTN_DI_REGISTRATIONS", json.dumps({"CPU_ATTN": CPU_ATTN_PATH}))
        assert "ATTN_DI_REGISTRATIONS" not in get_env_vars_to_copy()
        bridge.install()
        assert envs.VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY == "MY_APP_,ATTN_DI_"
        assert "ATTN_DI_REGISTRATIONS" in get_env_vars_to_copy()
        bridge.install()  # idempotent: added once
        bridge.uninstall()
        assert envs.VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY == "MY_APP_"
        monkeypatch.delenv(RAY_PREFIXES)
        bridge.install()
        assert envs.VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY == "ATTN_DI_"
        bridge.uninstall()
        assert RAY_PREFIXES not in os.environ
    finally:
        bridge.install()


def test_ray_runtime_env_after_vllms_register_backend_carries_it() -> None:
    """vLLM's register_backend, then attn_di.ray_runtime_env() before the bridge is
    installed: the runtime_env carries the registration (it used to export ``{}``, which
    replaced the driver's variable in every Ray worker)."""
    bridge.uninstall()
    try:
        registry.register_backend(AttentionBackendEnum.CPU_ATTN, TORCH_SDPA_PATH)
        env_vars = attn_di.ray_runtime_env()["env_vars"]
        assert json.loads(env_vars["ATTN_DI_REGISTRATIONS"]) == {"CPU_ATTN": TORCH_SDPA_PATH}
    finally:
        registry._ATTN_OVERRIDES.clear()
        bridge.install()
