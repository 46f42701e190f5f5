"""``override(..., propagate=True)``: an importable override reaches the processes started in
its block, through ATTN_DI_REGISTRATIONS, and is refused, naming why, where it could not."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace
from unittest import mock

import pytest
from dependency_injector import containers, providers

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    InvalidBackendTypeError,
    MambaAttentionBackendEnum,
    UnexportableBackendError,
    get_container,
    propagate_registrations,
    ray_runtime_env,
    register_backend,
    set_auto_propagation,
)

CUSTOM = AttentionBackendEnum.CUSTOM
CPU_ATTN = AttentionBackendEnum.CPU_ATTN
ENV = "ATTN_DI_REGISTRATIONS"
VLLM_REGISTRY = "vllm.v1.attention.backends.registry"  # vLLM's module, never imported here
BACKENDS = """
class Registered:
    pass

class Overriding:
    pass
"""


@pytest.fixture(autouse=True)
def _auto() -> Iterator[None]:
    """Automatic propagation on (attn_di's test isolation turns it off)."""
    previous = set_auto_propagation(True)
    yield
    set_auto_propagation(previous)


def resolve_in_child(name: str) -> tuple[str, str]:
    """Run in a spawn child: the member's path and its class's name."""
    container = get_container()
    return container.get_path(name), container.backend(name).__name__


def _variable() -> dict[str, str] | None:
    encoded = os.environ.get(ENV)
    return None if encoded is None else dict(json.loads(encoded))


def test_a_spawn_child_started_in_the_block_resolves_the_override(
    make_module: Callable[[str, str], str],
) -> None:
    """Inside the block a spawn child resolves the overriding class; after it, the variable
    holds the registration again."""
    module = make_module("propagated_pkg.backends", BACKENDS)
    register_backend(CUSTOM, f"{module}.Registered")
    overriding = __import__(module, fromlist=["Overriding"]).Overriding
    context = multiprocessing.get_context("spawn")
    with get_container().override(CUSTOM, overriding, propagate=True) as handle:
        assert _variable() == {"CUSTOM": f"{module}.Overriding"}
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            resolved = pool.submit(resolve_in_child, "CUSTOM").result(timeout=120)
        assert handle.propagate
        assert "propagated active" in repr(handle)
    assert resolved == (f"{module}.Overriding", "Overriding")
    assert _variable() == {"CUSTOM": f"{module}.Registered"}
    assert get_container().source(CUSTOM) == "registered"


def test_the_variable_holds_the_override_only_for_the_block() -> None:
    """A member with no registration: the variable appears with the block and goes with it;
    a plain override block beside it is never exported."""
    assert ENV not in os.environ
    container = get_container()
    with container.override(CPU_ATTN, "collections.OrderedDict", propagate=True):
        assert _variable() == {"CPU_ATTN": "collections.OrderedDict"}
        with container.override(CUSTOM, "collections.Counter"):
            assert container.export_registrations() == {"CPU_ATTN": "collections.OrderedDict"}
        with propagate_registrations() as handle:  # the explicit snapshot has it too
            assert handle.snapshot == {"CPU_ATTN": "collections.OrderedDict"}
    assert ENV not in os.environ
    assert container.export_registrations() == {}


def test_a_plain_block_over_a_propagated_one_exports_the_propagated_class() -> None:
    """The variable carries the newest propagated layer: what this process resolves above it
    (a plain block) is not exported, and is what vLLM's start-up check refuses."""
    container = get_container()
    with container.override(CPU_ATTN, "collections.OrderedDict", propagate=True):
        with container.override(CPU_ATTN, "collections.Counter"):
            assert container.get_path(CPU_ATTN) == "collections.Counter"
            assert _variable() == {"CPU_ATTN": "collections.OrderedDict"}
        assert container.get_path(CPU_ATTN) == "collections.OrderedDict"


def _refused(call: Callable[[], object]) -> UnexportableBackendError:
    """``call()`` raises UnexportableBackendError and changes nothing."""
    before = os.environ.get(ENV)
    with pytest.raises(UnexportableBackendError) as caught:
        call()
    assert get_container().active_overrides() == []
    assert os.environ.get(ENV) == before
    return caught.value


def test_a_class_defined_in_a_function_is_refused() -> None:
    """No importable path: refused, naming the member, the path and the fix."""

    class LocalBackend:
        pass

    error = _refused(lambda: get_container().override(CUSTOM, LocalBackend, propagate=True))
    assert (error.member, error.kind) == ("CUSTOM", "override")
    assert error.class_path.endswith("<locals>.LocalBackend")
    assert str(error).startswith("cannot propagate the override of CUSTOM: class ")
    assert "does not import back to the same class in a new process" in str(error)
    assert "Hint: override with a class defined at module level" in str(error)


def test_a_test_double_is_refused() -> None:
    """A mock is no class another process can import."""
    double = mock.Mock()
    error = _refused(lambda: get_container().override({CUSTOM: double}, propagate=True))
    assert "is a Mock object (a test double?), not a class another process can import" in str(error)
    assert str(error).startswith("cannot propagate the override of CUSTOM: object 'unittest.mock")


def test_it_is_refused_where_the_variable_would_not_be_written() -> None:
    """Automatic propagation off, an explicit snapshot in place, or another container than the
    default: each refused with its reason."""
    set_auto_propagation(False)
    error = _refused(lambda: get_container().override(CUSTOM, "a.B", propagate=True))
    assert "automatic propagation is off" in error.reason
    assert "set_auto_propagation(True)" in str(error.hint)
    set_auto_propagation(True)
    with propagate_registrations():
        error = _refused(lambda: get_container().override(CUSTOM, "a.B", propagate=True))
    assert "a propagate_registrations() handle's snapshot is in place" in error.reason
    error = _refused(lambda: BackendContainer().override(CUSTOM, "a.B", propagate=True))
    assert "only the default container's" in error.reason


def test_local_and_container_overrides_refuse_propagate() -> None:
    """propagate=True is for global member overrides; a non-bool is refused too."""
    container = get_container()
    with pytest.raises(InvalidBackendTypeError, match="local override"):
        container.override(CUSTOM, "a.B", local=True, propagate=True)

    class Other(containers.DeclarativeContainer):
        CUSTOM = providers.Object(object)

    with pytest.raises(InvalidBackendTypeError, match="dependency-injector container"):
        container.override(Other, propagate=True)
    with pytest.raises(InvalidBackendTypeError, match="True or False"):
        container.override(CUSTOM, "a.B", propagate="yes")  # type: ignore[arg-type]
    assert container.active_overrides() == []
    assert ENV not in os.environ


def _vllm_registry(**dicts: object) -> SimpleNamespace:
    """A stand-in for vLLM's registry module (``_ATTN_OVERRIDES`` keyed by members)."""
    return SimpleNamespace(**dicts)


def test_ray_runtime_env_carries_vllms_own_registrations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's register_backend before attn_di's bridge is installed: the runtime_env carries
    it (attn_di's own registration of a member wins), so it never hides it from Ray
    workers; the bridge's views (not plain dicts) are left to the snapshot."""
    fake = _vllm_registry(  # keyed by members of the same names (vLLM's enums are twins)
        _ATTN_OVERRIDES={AttentionBackendEnum.FLASH_ATTN: "pkg.Flash", CPU_ATTN: "pkg.VllmSide"},
        _MAMBA_ATTN_OVERRIDES={MambaAttentionBackendEnum.MAMBA2: "pkg.Mamba"},
    )
    monkeypatch.setitem(sys.modules, VLLM_REGISTRY, fake)
    register_backend(CPU_ATTN, "pkg.AttnDISide")
    encoded = ray_runtime_env()["env_vars"][ENV]
    assert json.loads(encoded) == {
        "CPU_ATTN": "pkg.AttnDISide",
        "FLASH_ATTN": "pkg.Flash",
        "mamba:MAMBA2": "pkg.Mamba",
    }
    view = mock.MagicMock(spec=dict)  # a mapping that is not a plain dict: the bridge's view
    monkeypatch.setitem(sys.modules, VLLM_REGISTRY, _vllm_registry(_ATTN_OVERRIDES=view))
    assert json.loads(ray_runtime_env()["env_vars"][ENV]) == {"CPU_ATTN": "pkg.AttnDISide"}


def test_the_not_propagated_hint_for_a_local_override_says_to_drop_local() -> None:
    """propagate=True is refused with local=True: for a local override block the hint says
    to enter it without local=True; other sources get no such clause."""
    from attn_di.exceptions import BackendNotPropagatedError

    def hint(source: str) -> str:
        error = BackendNotPropagatedError(
            "CPU_ATTN", "pkg.mod.Cls", source, "the worker process", "why", None
        )
        return str(error.hint)

    assert hint("local override").endswith(
        "propagate=True) (without local=True: a local override stays in its thread)"
    )
    assert "local=True" not in hint("override")
