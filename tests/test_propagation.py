"""Registrations reach worker processes through ATTN_DI_REGISTRATIONS."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    RegistrationsEnvError,
    UnexportableBackendError,
    get_container,
    propagate_registrations,
    ray_runtime_env,
    register_backend,
)

CUSTOM = AttentionBackendEnum.CUSTOM
ENV = "ATTN_DI_REGISTRATIONS"
BACKEND_MODULE = """
class Backend:
    pass
"""


def resolve_in_child(names: list[str]) -> dict[str, tuple[str, str, str]]:
    """Run in a child process: each member's path, source and resolved class name."""
    container = get_container()
    return {
        name: (container.get_path(name), container.source(name), container.backend(name).__name__)
        for name in names
    }


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )


# The forkserver starts at its first use in this process (here), after the variable is written.
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_children_see_the_parents_registrations(
    start_method: str, make_module: Callable[[str, str], str], new_name: Callable[[], str]
) -> None:
    """Spawn and forkserver children resolve dotted-path registrations and runtime members."""
    module = make_module(f"child_pkg_{start_method}.mod", BACKEND_MODULE)
    runtime_name = new_name()
    register_backend(CUSTOM, f"{module}.Backend")
    register_backend(runtime_name, f"{module}:Backend")
    context = multiprocessing.get_context(start_method)
    with (
        propagate_registrations(),
        ProcessPoolExecutor(max_workers=1, mp_context=context) as pool,
    ):
        resolved = pool.submit(resolve_in_child, ["CUSTOM", runtime_name]).result(timeout=120)
    assert resolved == {
        "CUSTOM": (f"{module}.Backend", "registered", "Backend"),
        runtime_name: (f"{module}:Backend", "default", "Backend"),
    }


def test_pool_initializer_applies_the_snapshot(
    make_module: Callable[[str, str], str], new_name: Callable[[], str]
) -> None:
    """``initializer``/``initargs`` apply the snapshot even when the environment is not read."""
    module = make_module("initializer_pkg.mod", BACKEND_MODULE)
    runtime_name = new_name()
    register_backend(runtime_name, f"{module}.Backend")
    handle = propagate_registrations()
    handle.restore()  # children get the snapshot only through the initializer
    assert ENV not in os.environ
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=handle.initializer,
        initargs=handle.initargs,
    ) as pool:
        resolved = pool.submit(resolve_in_child, [runtime_name]).result(timeout=120)
    assert resolved[runtime_name][2] == "Backend"


def test_propagate_writes_and_restores_the_variable(container: BackendContainer) -> None:
    """The handle holds the snapshot; ``with`` restores the previous value on exit."""
    os.environ[ENV] = "{}"
    register_backend(CUSTOM, "collections.OrderedDict")
    with propagate_registrations() as handle:
        assert handle.active
        assert handle.snapshot == {"CUSTOM": "collections.OrderedDict"}
        assert json.loads(os.environ[ENV]) == handle.snapshot
        assert handle.environ == {ENV: os.environ[ENV]}
    assert not handle.active
    assert os.environ[ENV] == "{}"
    handle.restore()  # a second restore is a no-op
    assert os.environ[ENV] == "{}"


def test_overrides_are_not_propagated(container: BackendContainer) -> None:
    """Override blocks are scoped to this process: only registrations are exported."""
    with container.override(CUSTOM, "collections.Counter"), propagate_registrations() as handle:
        assert handle.snapshot == {}


def test_unexportable_class_fails_clearly_and_writes_nothing() -> None:
    """A class defined in a function has no importable path: the error names it."""

    @register_backend(CUSTOM)
    class LocalBackend:
        pass

    with pytest.raises(UnexportableBackendError) as caught:
        propagate_registrations()
    assert caught.value.member == "CUSTOM"
    assert caught.value.class_path.endswith("<locals>.LocalBackend")
    assert "LocalBackend" in str(caught.value)
    assert "Hint: define the class at module level" in str(caught.value)
    assert ENV not in os.environ
    with pytest.raises(UnexportableBackendError, match="LocalBackend"):
        ray_runtime_env()


def test_import_applies_the_inherited_registrations() -> None:
    """A process started with the variable resolves its members right after import."""
    snapshot = {"CUSTOM": "collections.OrderedDict", "INHERITED_ATTN": "collections.Counter"}
    code = (
        "import attn_di; from attn_di import AttentionBackendEnum as E; "
        "print(E.CUSTOM.get_class().__name__, E.INHERITED_ATTN.get_class().__name__)"
    )
    result = _run_python(code, {ENV: json.dumps(snapshot)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OrderedDict", "Counter"]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("{not json", "not JSON"),
        ('["CUSTOM"]', "expected a JSON object {name: class path}, got list"),
        ('{"CUSTOM": "not a path"}', "invalid backend class path 'not a path'"),
    ],
)
def test_malformed_variable_fails_at_import(value: str, reason: str) -> None:
    """A malformed value stops ``import attn_di`` with RegistrationsEnvError and a hint."""
    result = _run_python("import attn_di", {ENV: value})
    assert result.returncode == 1
    assert "attn_di.exceptions.RegistrationsEnvError: cannot apply the registrations" in (
        result.stderr
    )
    assert reason in result.stderr
    assert "Hint: ATTN_DI_REGISTRATIONS is written by attn_di.propagate_registrations()" in (
        result.stderr
    )


def test_ray_runtime_env_extends_the_given_one(
    monkeypatch: pytest.MonkeyPatch, container: BackendContainer
) -> None:
    """ray_runtime_env keeps the caller's keys and env_vars and adds attn_di's variables."""
    register_backend(CUSTOM, "collections.OrderedDict")
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny")
    given = {"pip": ["x"], "env_vars": {"OTHER": "1"}}
    runtime_env = ray_runtime_env(given)
    assert runtime_env == {
        "pip": ["x"],
        "env_vars": {
            "OTHER": "1",
            ENV: '{"CUSTOM":"collections.OrderedDict"}',
            "ATTN_DI_PLUGINS": "tiny",
        },
    }
    assert given == {"pip": ["x"], "env_vars": {"OTHER": "1"}}
    empty = ray_runtime_env(container=BackendContainer())
    assert empty == {"env_vars": {ENV: "{}", "ATTN_DI_PLUGINS": "tiny"}}


def test_inherited_registrations_error_keeps_its_data(
    monkeypatch: pytest.MonkeyPatch, container: BackendContainer
) -> None:
    """The error carries the variable, its value and the reason; nothing is applied."""
    from attn_di._propagation import apply_inherited_registrations

    value = '{"CUSTOM": "collections.OrderedDict", "FLASH_ATTN": 3}'
    monkeypatch.setenv(ENV, value)
    with pytest.raises(RegistrationsEnvError) as caught:
        apply_inherited_registrations()
    assert isinstance(caught.value, ValueError)
    assert caught.value.variable == ENV
    assert caught.value.value == value
    assert "snapshot['FLASH_ATTN']" in caught.value.reason
    assert container.source(CUSTOM) == "unset"


def test_applying_a_snapshot_twice_is_harmless(new_name: Callable[[], str]) -> None:
    """apply_snapshot (the pool initializer) also works where the members already exist."""
    from attn_di._propagation import apply_snapshot

    runtime_name = new_name()
    snapshot = {"CUSTOM": "collections.OrderedDict", runtime_name: "collections.Counter"}
    apply_snapshot(snapshot)
    apply_snapshot(snapshot)
    assert AttentionBackendEnum[runtime_name].get_class().__name__ == "Counter"
    assert CUSTOM.get_class().__name__ == "OrderedDict"


def test_handles_restore_in_any_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out-of-order restores leave the newest active snapshot, then the original value."""
    from attn_di import AttentionBackendEnum, propagate_registrations, register_backend

    monkeypatch.setenv("ATTN_DI_REGISTRATIONS", "{}")
    register_backend(AttentionBackendEnum.CUSTOM, "collections.OrderedDict")
    first = propagate_registrations()
    register_backend(AttentionBackendEnum.CUSTOM, "collections.Counter")
    second = propagate_registrations()
    first.restore()
    assert os.environ["ATTN_DI_REGISTRATIONS"] == second.environ["ATTN_DI_REGISTRATIONS"]
    second.restore()
    assert os.environ["ATTN_DI_REGISTRATIONS"] == "{}"


def test_ray_runtime_env_refuses_main_module_classes_and_bad_arguments() -> None:
    """A __main__ class cannot reach Ray workers; a non-mapping runtime_env is a TypeError."""
    from attn_di import AttentionBackendEnum, ray_runtime_env, register_backend
    from attn_di.exceptions import InvalidBackendTypeError, UnexportableBackendError

    with pytest.raises(InvalidBackendTypeError, match="runtime_env must be a mapping"):
        ray_runtime_env("notadict")  # type: ignore[arg-type]
    register_backend(AttentionBackendEnum.CUSTOM, "__main__.DriverBackend")
    with pytest.raises(UnexportableBackendError, match="__main__ module, which Ray workers"):
        ray_runtime_env()
