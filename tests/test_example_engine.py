"""The example engine receives its backend by injection; tests swap it with overrides."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from dependency_injector.wiring import Provide, UnresolvedMarkerWarning, inject

from attn_di import AttentionBackendEnum, BackendContainer, register_backend, use_container

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine"
CUSTOM = AttentionBackendEnum.CUSTOM


@pytest.fixture(name="engine_module")
def _engine_module(
    container: BackendContainer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    module = importlib.import_module("engine")
    register_backend(CUSTOM, "toy_backend.ToyBackend")
    container.wire(modules=[module], warn_unresolved=True)
    yield module
    container.unwire()


def test_engine_gets_the_registered_backend(engine_module: ModuleType) -> None:
    """The constructor's Provide[BackendContainer.CUSTOM] injects the registered class."""
    engine = engine_module.ToyEngine()
    assert engine.backend_cls.get_name() == "TOY"
    outputs = engine.decode(steps=4)
    assert len(outputs) == 4
    assert len(engine.kv_cache) == 4


def test_engine_with_a_mock_backend(
    engine_module: ModuleType, container: BackendContainer, mocker: Any
) -> None:
    """An override with mocker.Mock(spec=...) reaches the engine; the impl is called per step."""
    toy_backend = importlib.import_module("toy_backend")
    fake_backend = mocker.Mock(spec=toy_backend.ToyBackend)
    fake_impl = fake_backend.get_impl_cls.return_value.return_value
    fake_impl.forward.return_value = [0.5] * 8
    with container.override(CUSTOM, fake_backend):
        engine = engine_module.ToyEngine()
        outputs = engine.decode(steps=3)
    assert engine.backend_cls is fake_backend
    fake_backend.get_impl_cls.return_value.assert_called_once_with(head_size=8, scale=8**-0.5)
    assert fake_impl.forward.call_count == 3
    assert outputs == [[0.5] * 8] * 3
    assert engine_module.ToyEngine().backend_cls.get_name() == "TOY"


def test_engine_with_a_spy_on_the_real_impl(
    engine_module: ModuleType, container: BackendContainer, mocker: Any
) -> None:
    """Swapping in UniformBackend by path and spying its impl: forward runs once per step."""
    toy_backend = importlib.import_module("toy_backend")
    spy = mocker.spy(toy_backend.UniformAttentionImpl, "forward")
    with container.override(CUSTOM, "toy_backend.UniformBackend"):
        engine = engine_module.ToyEngine()
        engine.decode(steps=5)
    assert spy.call_count == 5
    first_value = spy.call_args_list[0].args[3]
    assert engine.kv_cache[0][1] == first_value
    assert engine.step([0.0] * 8, [0.0] * 8, [6.0] * 8)[0] == pytest.approx(
        sum(value[0] for _, value in engine.kv_cache) / len(engine.kv_cache)
    )


def test_overrides_after_wiring_apply_at_call_time(
    engine_module: ModuleType, container: BackendContainer
) -> None:
    """Registrations and overrides made after wiring reach the next injection."""
    register_backend(CUSTOM, "toy_backend.UniformBackend")
    assert engine_module.ToyEngine().backend_cls.get_name() == "UNIFORM"


def test_use_container_rewires_injection(engine_module: ModuleType) -> None:
    """A fresh default installed by use_container is the one wired modules inject from."""
    with use_container() as fresh:
        register_backend(CUSTOM, "toy_backend.UniformBackend")
        assert fresh.source(CUSTOM) == "registered"
        assert engine_module.ToyEngine().backend_cls.get_name() == "UNIFORM"
    assert engine_module.ToyEngine().backend_cls.get_name() == "TOY"


@inject
def _misspelled(backend_cls: Any = Provide["TRITON_ATN"]) -> Any:
    return backend_cls


def test_a_misspelled_marker_fails_loudly(container: BackendContainer) -> None:
    """warn_unresolved=True flags an unresolvable marker; the project's pytest config errors."""
    with pytest.raises(
        UnresolvedMarkerWarning, match="Unresolved marker backend_cls in _misspelled"
    ):
        container.wire(modules=[sys.modules[__name__]], warn_unresolved=True)
    container.unwire()


def test_the_example_runs_as_a_script() -> None:
    """``python examples/engine/engine.py`` injects, overrides and restores."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "engine.py")], capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "CUSTOM -> toy_backend.ToyBackend (registered)"
    assert "injected TOY" in lines[1]
    assert "inside override: injected UNIFORM" in lines[2]
    assert lines[3] == "  after the block: injected TOY"
