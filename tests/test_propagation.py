"""Registrations reach worker processes through ATTN_DI_REGISTRATIONS."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    MambaAttentionBackendEnum,
    RegistrationsEnvError,
    UnexportableBackendError,
    get_container,
    propagate_registrations,
    ray_runtime_env,
    register_backend,
    set_auto_propagation,
    use_container,
)
from attn_di.exceptions import AttnDIWarning, UnexportableBackendWarning

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
    assert "Hint: ATTN_DI_REGISTRATIONS is written by attn_di in the parent process" in (
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


# -- automatic propagation --------------------------------------------------------------------
@pytest.fixture(name="auto")
def _auto() -> Iterator[None]:
    """Automatic propagation on for the test (attn_di's test isolation turns it off)."""
    previous = set_auto_propagation(True)
    yield
    set_auto_propagation(previous)


@pytest.mark.usefixtures("auto")
def test_spawn_child_sees_a_registration_with_no_propagation_call(
    make_module: Callable[[str, str], str], new_name: Callable[[], str]
) -> None:
    """A spawn child started after register_backend() resolves it: no propagate call at all."""
    module = make_module("auto_child_pkg.mod", BACKEND_MODULE)
    runtime_name = new_name()
    register_backend(CUSTOM, f"{module}.Backend")
    register_backend(runtime_name, f"{module}:Backend", is_mamba=True)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        resolved = pool.submit(resolve_in_child, ["CUSTOM"]).result(timeout=120)
        mamba = pool.submit(resolve_mamba_in_child, runtime_name).result(timeout=120)
    assert resolved == {"CUSTOM": (f"{module}.Backend", "registered", "Backend")}
    assert mamba == f"{module}:Backend"


def resolve_mamba_in_child(name: str) -> str:
    """Run in a child process: the path of a Mamba member."""
    return MambaAttentionBackendEnum[name].get_path()


@pytest.mark.usefixtures("auto")
def test_the_variable_follows_registrations_clears_and_containers() -> None:
    """Registration, clear_override and use_container enter/exit rewrite the variable."""
    register_backend(CUSTOM, "collections.OrderedDict")
    assert json.loads(os.environ[ENV]) == {"CUSTOM": "collections.OrderedDict"}
    with use_container():
        assert ENV not in os.environ  # the new default has no registrations
        register_backend(AttentionBackendEnum.FLASH_ATTN, "collections.Counter")
        assert json.loads(os.environ[ENV]) == {"FLASH_ATTN": "collections.Counter"}
    assert json.loads(os.environ[ENV]) == {"CUSTOM": "collections.OrderedDict"}
    CUSTOM.clear_override()
    assert ENV not in os.environ


@pytest.mark.usefixtures("auto")
def test_a_local_class_is_left_out_with_a_warning() -> None:
    """A class defined in a function registers fine; it is left out with a warning naming it."""
    register_backend(AttentionBackendEnum.FLASH_ATTN, "collections.Counter")

    class LocalBackend:
        pass

    with pytest.warns(UnexportableBackendWarning, match=r"CUSTOM .*LocalBackend"):
        register_backend(CUSTOM, LocalBackend)
    assert get_container().backend(CUSTOM) is LocalBackend
    assert json.loads(os.environ[ENV]) == {"FLASH_ATTN": "collections.Counter"}
    with pytest.raises(UnexportableBackendError, match="LocalBackend"):
        propagate_registrations()  # the explicit form stays strict


@pytest.mark.usefixtures("auto")
def test_an_explicit_handle_wins_while_active() -> None:
    """While a propagate_registrations() handle is active, its snapshot stays in the variable."""
    register_backend(CUSTOM, "collections.OrderedDict")
    with propagate_registrations() as handle:
        register_backend(AttentionBackendEnum.FLASH_ATTN, "collections.Counter")
        assert os.environ[ENV] == handle.environ[ENV]
    assert json.loads(os.environ[ENV]) == {
        "CUSTOM": "collections.OrderedDict",
        "FLASH_ATTN": "collections.Counter",
    }


def test_the_switch_turns_it_off() -> None:
    """set_auto_propagation(False) (the test default) leaves the variable alone."""
    assert set_auto_propagation(False) is False
    register_backend(CUSTOM, "collections.OrderedDict")
    assert ENV not in os.environ


def test_the_environment_switch_turns_it_off_at_import() -> None:
    """ATTN_DI_AUTO_PROPAGATE=0 at start-up: registrations are not written."""
    code = (
        "import os, attn_di\n"
        "attn_di.register_backend(attn_di.AttentionBackendEnum.CUSTOM, 'collections.Counter')\n"
        "print('ATTN_DI_REGISTRATIONS' in os.environ)"
    )
    off = _run_python(code, {"ATTN_DI_AUTO_PROPAGATE": "0"})
    on = _run_python(code, {})
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


# -- with warnings as errors, a call that raises its warning changes nothing ------------------
def _local_class(name: str) -> type:
    """A class defined in a function (no importable path), with a unique qualified name, so
    that the once-per-path warning is not already spent by another test."""
    return type(name, (), {"__qualname__": f"_local_class.<locals>.{name}"})


@pytest.fixture(name="warnings_are_errors")
def _warnings_are_errors() -> Iterator[None]:
    """Every warning raised as an error (as ``-W error`` does), for the test."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.usefixtures("auto", "warnings_are_errors")
def test_an_unexportable_registration_that_raises_its_warning_is_undone(
    new_name: Callable[[], str],
) -> None:
    """register_backend(member, local class) raises UnexportableBackendWarning as an error:
    the previous registration and the variable are as they were."""
    register_backend(CUSTOM, "collections.OrderedDict")
    before = os.environ[ENV]
    with pytest.raises(UnexportableBackendWarning):
        register_backend(CUSTOM, _local_class(f"Local{new_name()}"))
    assert get_container().get_path(CUSTOM) == "collections.OrderedDict"
    assert os.environ[ENV] == before


@pytest.mark.usefixtures("auto", "warnings_are_errors")
def test_a_new_member_whose_warning_raises_is_not_created(new_name: Callable[[], str]) -> None:
    """A new name registered with a local class: the warning raises, the member is gone."""
    name = new_name()
    before = os.environ.get(ENV)
    with pytest.raises(UnexportableBackendWarning):
        register_backend(name, _local_class(f"Local{name}"))
    assert name not in AttentionBackendEnum.__members__
    assert os.environ.get(ENV) == before


@pytest.mark.usefixtures("auto", "warnings_are_errors")
def test_a_case_twin_whose_warning_raises_is_not_created(new_name: Callable[[], str]) -> None:
    """A name differing from a member only by case warns before anything changes."""
    name = new_name()
    register_backend(name, "collections.OrderedDict")
    before = os.environ[ENV]
    twin = name.lower()
    for register in (
        lambda: register_backend(twin, "collections.Counter"),
        lambda: AttentionBackendEnum.register(twin, "collections.Counter"),
        lambda: get_container().apply_registrations({"CUSTOM": "a.B", twin: "collections.Counter"}),
    ):
        with pytest.raises(AttnDIWarning, match="only by case"):
            register()
        assert twin not in AttentionBackendEnum.__members__
        assert not CUSTOM.is_overridden()
        assert os.environ[ENV] == before


@pytest.mark.usefixtures("warnings_are_errors")
def test_switching_propagation_on_that_raises_its_warning_changes_nothing(
    new_name: Callable[[], str],
) -> None:
    """set_auto_propagation(True) with an unexportable registration: the warning raises, the
    switch stays off and the variable is untouched."""
    register_backend(CUSTOM, _local_class(f"Local{new_name()}"))  # off: nothing warns
    os.environ[ENV] = '{"FLASH_ATTN":"collections.Counter"}'
    with pytest.raises(UnexportableBackendWarning):
        set_auto_propagation(True)
    assert set_auto_propagation(False) is False
    assert os.environ[ENV] == '{"FLASH_ATTN":"collections.Counter"}'


@pytest.mark.usefixtures("auto", "warnings_are_errors")
def test_use_container_whose_warning_raises_keeps_the_default(new_name: Callable[[], str]) -> None:
    """Entering use_container(c) with an unexportable registration in c: the warning raises
    at the ``with``, and the previous default container stays the default."""
    default = get_container()
    other = BackendContainer()
    other.register(CUSTOM, _local_class(f"Local{new_name()}"))
    with pytest.raises(UnexportableBackendWarning), use_container(other):
        pytest.fail("the block must not run")
    assert get_container() is default


def test_a_refused_inherited_variable_stays_as_inherited() -> None:
    """``import attn_di`` refusing ATTN_DI_REGISTRATIONS leaves the variable as it came (the
    default container it made on the way does not rewrite it), so a second import refuses
    it again instead of running without the registrations."""
    code = (
        "import os\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        import attn_di\n"
        "    except ValueError as error:\n"
        "        print(type(error).__name__, os.environ['ATTN_DI_REGISTRATIONS'])\n"
    )
    result = _run_python(code, {ENV: '{"CUSTOM": 3}'})
    assert result.stdout.splitlines() == ['RegistrationsEnvError {"CUSTOM": 3}'] * 2
