"""Races and faults found by trying to break attn_di: concurrent members, plugins that raise
BaseException, local overrides restored from other threads, bad paths, bad configs."""

from __future__ import annotations

import collections
import importlib
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from importlib.metadata import EntryPoint
from typing import Any

import pytest
from dependency_injector import providers

import attn_di
from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    BackendImportError,
    InvalidBackendTypeError,
    MambaAttentionBackendEnum,
    UnknownBackendError,
    _plugins,
    load_plugins,
    parse_backend_name,
    register_backend,
    select_backend,
)
from attn_di.exceptions import UnexportableBackendWarning

E = AttentionBackendEnum


def test_members_created_while_others_read(container: BackendContainer) -> None:
    """3 threads creating members while 3 export, iterate, print and parse: no exception."""
    errors: list[str] = []
    stop = threading.Event()
    prefix = f"RACE_{os.getpid()}_"

    def writer(index: int) -> None:
        try:
            for n in range(150):
                name = f"{prefix}{index}_{n}"
                enum = MambaAttentionBackendEnum if n % 3 == 0 else E
                register_backend(name, "collections.OrderedDict", is_mamba=enum is not E)
        except BaseException:
            errors.append(traceback.format_exc())

    def reader(kind: int) -> None:
        try:
            while not stop.is_set():
                if kind == 0:
                    container.export_registrations()
                elif kind == 1:
                    names = [m.name for m in E] + list(E.__members__)
                    repr(container)
                    assert names
                else:
                    parse_backend_name("cpu-attn")
                    with pytest.raises(ValueError, match="Unknown attention backend"):
                        E["NO_SUCH_MEMBER"]
        except BaseException:
            errors.append(traceback.format_exc())

    readers = [threading.Thread(target=reader, args=(kind,)) for kind in range(3)]
    writers = [threading.Thread(target=writer, args=(index,)) for index in range(3)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    assert errors == []
    assert sum(name.startswith(prefix) for name in E.__members__) == 300


def test_reading_the_tables_survives_a_change_during_the_copy(
    container: BackendContainer, new_name: Callable[[], str]
) -> None:
    """Copying a member table is one C call, but a garbage collection inside it runs Python
    code, and so can let another thread add a member mid-copy. Here every collection (one
    per allocation) adds a member itself, a few times: listing, iterating, exporting and
    parsing still return a whole snapshot."""
    import gc

    added: list[str] = []
    armed = False

    def add_a_member(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and armed and len(added) < 5:
            added.append(new_name())
            register_backend(added[-1], "collections.OrderedDict")

    readers = {
        "names": attn_di._enum.ATTENTION.names,
        "iteration": lambda: list(E),
        "export": container.export_registrations,
        "parse": lambda: parse_backend_name("cpu-attn"),
    }
    threshold = gc.get_threshold()
    gc.callbacks.append(add_a_member)
    try:
        for read in readers.values():
            added.clear()
            armed = True
            gc.set_threshold(1)
            try:
                assert read()
            finally:
                armed = False
                gc.set_threshold(*threshold)
            assert added  # the table did change during the read
    finally:
        gc.callbacks.remove(add_a_member)


# -- plugins that raise BaseException -----------------------------------------------------
PLUGIN_SOURCE = """
import collections
import enum
import sys
import attn_di
from dependency_injector.wiring import Provide, inject
from attn_di import AttentionBackendEnum as E, MambaAttentionBackendEnum as M

class Stop(BaseException):
    pass

def _partial():
    attn_di.register_backend(E.TRITON_ATTN, "collections.Counter")
    attn_di.register_backend("{new}", "collections.OrderedDict")
    attn_di.register_backend(M.CUSTOM, "collections.OrderedDict")
    attn_di.get_container().override(E.FLASH_ATTN, collections.Counter)
    attn_di.get_container().override(E.CPU_ATTN, collections.Counter, local=True)

def exits():
    _partial()
    sys.exit(3)

def interrupts():
    _partial()
    raise KeyboardInterrupt

def stops():
    _partial()
    raise Stop("custom BaseException")

def good():
    attn_di.register_backend(E.CUSTOM, "collections.OrderedDict")

@inject
def injected(backend=Provide[attn_di.BackendContainer.CPU_ATTN]):
    return backend

def unexportable():
    attn_di.register_backend("{new}", "collections.OrderedDict")

    class Local:
        pass

    attn_di.register_backend(E.FLASH_ATTN, Local)  # warns: no importable path

def di_overrides():
    from dependency_injector import providers
    container = attn_di.get_container()
    container.CPU_ATTN.override(providers.Object(collections.Counter))
    container.candidates.override(providers.Object(lambda device, config: ["TORCH_SDPA"]))
    container.attention.from_dict({"head_size": 64, "dtype": "float32"})
    container.mamba.MAMBA2.override(providers.Object(collections.Counter))
    container.wire(modules=[__name__])
    raise RuntimeError("fails after its dependency-injector overrides")

def removes():
    attn_di.remove_runtime_member(E.__members__["{new}"])
    raise RuntimeError("fails after removing a member")

def replaces():
    attn_di.remove_runtime_member(E.__members__["{new}"])
    attn_di.register_backend("{new}", "collections.Counter")
    raise RuntimeError("fails after replacing a member")

SEEN = []  # what the listeners of subscribes() were told
DROP = []  # what subscribes() calls first: the test's unsubscribe functions

class Foreign(enum.Enum):  # an enum subscribes() aliases
    CPU_ATTN = "collections.Counter"

class Kept(enum.Enum):  # an enum the test aliases (and subscribes() drops)
    CPU_ATTN = "collections.Counter"

def subscribes():
    for undo in DROP:
        undo()
    attn_di.on_member_added(lambda member: SEEN.append(("added", member.name)))
    attn_di.on_member_removed(lambda member: SEEN.append(("removed", member.name)))
    attn_di.register_enum_alias(Foreign, E)
    raise RuntimeError("fails after its subscriptions")
"""


@pytest.fixture(name="plugins")
def _plugins_fixture(
    make_module: Callable[[str, str], str],
    monkeypatch: pytest.MonkeyPatch,
    new_name: Callable[[], str],
) -> Callable[[list[str]], str]:
    """Install fake ``attn_di.plugins`` entry points to functions of one module; returns the
    name of the member the failing plugins try to create."""
    member_name = new_name()
    module = make_module(
        f"fault_plugins_{member_name.lower()}", PLUGIN_SOURCE.replace("{new}", member_name)
    )

    def install(functions: list[str]) -> str:
        entry_points = [EntryPoint(fn, f"{module}:{fn}", _plugins.PLUGIN_GROUP) for fn in functions]
        monkeypatch.setattr(_plugins, "_entry_points", lambda: entry_points)
        return member_name

    return install


def _assert_rolled_back(container: BackendContainer, member_name: str) -> None:
    assert not E.TRITON_ATTN.is_overridden()
    assert not MambaAttentionBackendEnum.CUSTOM.is_overridden()
    assert member_name not in E.__members__
    assert container.active_overrides() == []
    assert not E.CPU_ATTN.is_overridden()  # the local layer too


@pytest.mark.parametrize("failing", ["exits", "stops"])
def test_base_exception_plugin_is_rolled_back_and_later_ones_load(
    failing: str, plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """SystemExit or a custom BaseException: rolled back (registrations, members, overrides),
    recorded as failed, the next plugin loads, and a second load does not run it again."""
    member_name = plugins([failing, "good"])
    report = load_plugins()
    _assert_rolled_back(container, member_name)
    assert [(p.name, p.status) for p in report.plugins] == [(failing, "failed"), ("good", "loaded")]
    assert report.failed[0].error is not None
    assert container.backend(E.CUSTOM) is collections.OrderedDict
    E.CUSTOM.clear_override()
    assert load_plugins().plugins == report.plugins
    assert not E.CUSTOM.is_overridden()  # "good" did not run again either


def test_keyboard_interrupt_is_rolled_back_then_reraised(
    plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """KeyboardInterrupt: rolled back and recorded, then re-raised; the plugins not reached load
    at the next load_plugins(), and the interrupted one is not run again."""
    member_name = plugins(["interrupts", "good"])
    with pytest.raises(KeyboardInterrupt):
        load_plugins()
    _assert_rolled_back(container, member_name)
    assert [(p.name, p.status) for p in attn_di.plugin_report().plugins] == [
        ("interrupts", "failed")
    ]
    report = load_plugins()
    assert [(p.name, p.status) for p in report.plugins] == [
        ("interrupts", "failed"),
        ("good", "loaded"),
    ]
    assert member_name not in E.__members__


def test_a_failed_plugins_dependency_injector_overrides_are_undone(
    plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """A plugin that overrides providers through dependency-injector itself (a member's
    provider, the candidate policy, the selection settings, a Mamba member) and wires a
    module, then raises: all of it is undone; selection is attn_di's own again."""
    attn_di.register_backend(E.FLASH_ATTN, "collections.deque")  # kept: made before
    plugins(["di_overrides"])
    (failed,) = load_plugins().failed
    assert failed.error == "RuntimeError: fails after its dependency-injector overrides"
    assert container.CPU_ATTN.overridden == ()
    assert container.candidates.overridden == ()
    assert container.attention.overridden == ()
    assert container.mamba.MAMBA2.overridden == ()
    assert container.active_overrides() == []
    assert container.wired_to_modules == []
    assert container.source(E.CPU_ATTN) == "default"
    assert container.source(E.FLASH_ATTN) == "registered"
    selection = select_backend({"head_size": 64, "dtype": "float32"}, device="cpu")
    assert selection.backend is E.CPU_ATTN
    module = sys.modules[next(m for m in sys.modules if m.startswith("fault_plugins_"))]
    assert not isinstance(module.injected(), type)  # unwired: the marker, not a class


@pytest.mark.parametrize(
    ("failing", "error"),
    [
        ("removes", "RuntimeError: fails after removing a member"),
        ("replaces", "RuntimeError: fails after replacing a member"),
    ],
)
def test_a_member_a_failed_plugin_removed_comes_back_whole(
    failing: str,
    error: str,
    plugins: Callable[[list[str]], str],
    container: BackendContainer,
    new_name: Callable[[], str],
) -> None:
    """A plugin that removes a runtime member made before it (or removes it and registers the
    name anew), then raises: the very member comes back, in its place among the members, with
    its very providers in every container (registrations, an override layer that still ends
    as usual, a dependency-injector override)."""
    member_name = plugins([failing])
    register_backend(member_name, "collections.OrderedDict")
    register_backend(new_name(), "collections.deque")  # a member after it
    member = E.__members__[member_name]
    other = BackendContainer()
    other.register(member, "collections.defaultdict")
    other.provider(member).override(providers.Object(collections.ChainMap))
    with container.override(member, collections.Counter):

        def state() -> tuple[object, ...]:
            return (
                list(E.__members__),
                E.__members__[member_name],
                container.export_registrations(),
                other.export_registrations(),
                container.provider(member),
                other.provider(member),
                container.backend(member),
                other.backend(member),
            )

        before = state()
        (failed,) = load_plugins().failed
        assert failed.error == error
        assert state() == before
    assert container.backend(member) is collections.OrderedDict  # the layer ended as usual
    assert container.active_overrides() == []
    assert other.backend(member) is collections.ChainMap
    other.provider(member).reset_override()
    assert other.backend(member) is collections.defaultdict


def test_a_failed_plugins_listeners_and_aliases_are_undone(
    plugins: Callable[[list[str]], str],
    container: BackendContainer,
    new_name: Callable[[], str],
) -> None:
    """A plugin that drops a listener and an enum alias made before it, subscribes listeners
    of its own and aliases another enum, then raises: its listeners are never called and its
    alias is not accepted; the listeners and the alias it dropped are back."""
    member_name = plugins(["subscribes"])
    module = importlib.import_module(f"fault_plugins_{member_name.lower()}")
    seen: list[tuple[str, str]] = []
    unsubscribes = [
        attn_di.on_member_added(lambda member: seen.append(("added", member.name))),
        attn_di.on_member_removed(lambda member: seen.append(("removed", member.name))),
    ]
    attn_di.register_enum_alias(module.Kept, E)
    module.DROP.extend([*unsubscribes, lambda: attn_di.unregister_enum_alias(module.Kept)])
    try:
        (failed,) = load_plugins().failed
        assert failed.error == "RuntimeError: fails after its subscriptions"
        later = new_name()
        register_backend(later, "collections.deque")
        attn_di.remove_runtime_member(E.__members__[later])
        assert module.SEEN == []
        assert seen == [("added", later), ("removed", later)]
        assert container.provider(module.Kept.CPU_ATTN) is container.provider(E.CPU_ATTN)
        with pytest.raises(InvalidBackendTypeError):
            container.provider(module.Foreign.CPU_ATTN)
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()
        attn_di.unregister_enum_alias(module.Kept)


def test_a_removal_listener_that_raises_does_not_stop_a_rollback(
    plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """A listener subscribed before the plugins, raising when the failed plugin's new member
    is removed: the rollback still ends whole and the next plugin loads (the error does not
    escape load_plugins)."""
    member_name = plugins(["exits", "good"])
    told: list[str] = []

    def picky(member: E) -> None:
        told.append(member.name)
        if member.name == member_name:
            raise ValueError("a listener fails for the plugin's member")

    unsubscribe = attn_di.on_member_removed(picky)
    try:
        report = load_plugins()
    finally:
        unsubscribe()
    assert member_name in told
    _assert_rolled_back(container, member_name)
    assert [(p.name, p.status) for p in report.plugins] == [("exits", "failed"), ("good", "loaded")]
    E.CUSTOM.clear_override()


def test_a_plugin_failing_on_a_warning_raised_as_an_error_is_rolled_back_whole(
    plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """With automatic propagation on and warnings as errors, a plugin whose registration
    raises UnexportableBackendWarning fails and is rolled back whole (its new member too);
    ATTN_DI_REGISTRATIONS is as before."""
    import warnings

    previous = attn_di.set_auto_propagation(True)
    try:
        attn_di.register_backend(E.CUSTOM, "collections.deque")
        before = os.environ["ATTN_DI_REGISTRATIONS"]
        member_name = plugins(["unexportable"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (failed,) = load_plugins().failed
        assert failed.error is not None
        assert failed.error.startswith("UnexportableBackendWarning")
        assert member_name not in E.__members__
        assert container.source(E.FLASH_ATTN) == "default"
        assert os.environ["ATTN_DI_REGISTRATIONS"] == before
    finally:
        attn_di.set_auto_propagation(previous)


def test_a_backend_module_raising_system_exit_is_an_import_failure(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """SystemExit (anything but KeyboardInterrupt) at a backend's import is a
    BackendImportError, and a rejection reason in selection; KeyboardInterrupt escapes."""
    exits = make_module("exits_at_import_mod", "raise SystemExit(0)\n")
    interrupts = make_module("interrupts_at_import_mod", "raise KeyboardInterrupt\n")
    attn_di.register_backend(E.CUSTOM, f"{exits}:Backend")
    with pytest.raises(BackendImportError, match="SystemExit") as caught:
        container.backend(E.CUSTOM)
    assert caught.value.reason == BackendImportError.MODULE_FAILED
    with container.candidates.override(
        providers.Callable(lambda device, config: [E.CUSTOM, E.CPU_ATTN])
    ):
        selection = select_backend({"head_size": 64, "dtype": "float32"}, device="cpu")
    assert selection.backend is E.CPU_ATTN
    assert "SystemExit" in selection.rejected[E.CUSTOM][0]
    attn_di.register_backend(E.CUSTOM, f"{interrupts}:Backend")
    with pytest.raises(KeyboardInterrupt):
        container.backend(E.CUSTOM)


def test_a_validate_configuration_raising_system_exit_is_a_rejection(
    container: BackendContainer,
) -> None:
    """A backend whose validate_configuration raises SystemExit is rejected, not the host's end."""

    class ExitingBackend:
        @classmethod
        def validate_configuration(cls, **kwargs: Any) -> list[str]:
            raise SystemExit(3)

    with (
        container.override(E.CUSTOM, ExitingBackend),
        container.candidates.override(
            providers.Callable(lambda device, config: [E.CUSTOM, E.CPU_ATTN])
        ),
    ):
        selection = select_backend({"head_size": 64, "dtype": "float32"}, device="cpu")
    assert selection.backend is E.CPU_ATTN
    assert selection.rejected[E.CUSTOM] == ["validate_configuration raised SystemExit: 3"]


# -- local overrides restored elsewhere -----------------------------------------------------
def test_local_override_restored_from_another_thread(container: BackendContainer) -> None:
    """restore() from another thread ends the layer in the context that made it."""
    register_backend(E.CUSTOM, "collections.OrderedDict")
    handle = container.override(E.CUSTOM, collections.Counter, local=True)
    assert container.backend(E.CUSTOM) is collections.Counter
    thread = threading.Thread(target=handle.restore)
    thread.start()
    thread.join()
    assert not handle.active
    assert container.backend(E.CUSTOM) is collections.OrderedDict
    assert E.CUSTOM.get_class() is collections.OrderedDict
    assert container.source(E.CUSTOM) == "registered"
    handle.restore()  # still a no-op


# -- bad inputs ---------------------------------------------------------------------------------
def test_a_path_to_a_function_is_refused_at_resolution(container: BackendContainer) -> None:
    """A registered path naming a function: a typed import error naming member and path."""
    register_backend(E.CUSTOM, "os.path.join")
    with pytest.raises(BackendImportError, match="not a class") as caught:
        container.backend(E.CUSTOM)
    assert caught.value.member == "CUSTOM"
    assert caught.value.class_path == "os.path.join"
    assert caught.value.reason == BackendImportError.NOT_A_CLASS


@pytest.mark.parametrize("config", [None, 128, "bfloat16", ["head_size"]])
def test_select_backend_refuses_what_is_not_a_config(config: Any) -> None:
    """Anything but a config or a mapping: a typed error naming ``config``."""
    with pytest.raises(InvalidBackendTypeError, match="config must be an AttentionSelectorConfig"):
        select_backend(config, device="cpu")


def test_select_backend_accepts_a_mapping() -> None:
    """A mapping of the config's fields selects like the config itself."""
    selection = select_backend({"head_size": 64, "dtype": "float32"}, device="cpu")
    assert selection.backend is E.CPU_ATTN
    with pytest.raises(ValueError, match="unknown keys"):
        select_backend({"head_size": 64, "dtype": "float32", "hed": 1}, device="cpu")


def test_deeply_nested_registrations_env_is_a_typed_error() -> None:
    """A deeply nested ATTN_DI_REGISTRATIONS fails at import with RegistrationsEnvError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_DI_")}
    env["ATTN_DI_REGISTRATIONS"] = "[" * 20_000 + "]" * 20_000
    code = (
        "try:\n import attn_di\nexcept Exception as e:\n"
        " print(type(e).__name__, isinstance(e, ValueError))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "RegistrationsEnvError True"


def test_containers_created_while_members_are_added() -> None:
    """BackendContainer() and use_container() in one thread while others add members: no error."""
    errors: list[BaseException] = []
    prefix = f"MADE_{os.getpid()}_"

    def writer(index: int) -> None:
        try:
            for n in range(200):
                register_backend(f"{prefix}{index}_{n}", "a.B", is_mamba=bool(n % 2))
        except BaseException as error:
            errors.append(error)

    def maker() -> None:
        try:
            for _ in range(60):
                assert isinstance(BackendContainer(), BackendContainer)
                with attn_di.use_container():
                    pass
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=maker))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_concurrent_registrations_leave_the_newest_snapshot(container: BackendContainer) -> None:
    """With automatic propagation, the variable equals the export once all writers finish."""
    previous = attn_di.set_auto_propagation(True)
    try:
        prefix = f"SNAP_{os.getpid()}_"
        threads = [
            threading.Thread(
                target=lambda i=i: [
                    register_backend(f"{prefix}{i}_{n}", "collections.OrderedDict")
                    for n in range(40)
                ]
            )
            for i in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == container.export_registrations()
    finally:
        attn_di.set_auto_propagation(previous)


def test_a_rolled_back_plugin_rewrites_the_snapshot(
    plugins: Callable[[list[str]], str], container: BackendContainer
) -> None:
    """With automatic propagation, the variable follows a failed plugin's rollback."""
    previous = attn_di.set_auto_propagation(True)
    try:
        register_backend(E.FLASH_ATTN, "collections.Counter")
        plugins(["exits"])
        load_plugins()
        assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {
            "FLASH_ATTN": "collections.Counter"
        }
    finally:
        attn_di.set_auto_propagation(previous)


def test_a_snapshot_too_large_for_the_environment_is_not_written(
    container: BackendContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the limit, the variable is removed with one warning (subprocesses still start)."""
    from attn_di import _propagation

    monkeypatch.setattr(_propagation, "AUTO_LIMIT", 60)
    monkeypatch.setattr(_propagation, "_warned_too_large", [])
    previous = attn_di.set_auto_propagation(True)
    try:
        register_backend(E.FLASH_ATTN, "collections.Counter")
        assert "ATTN_DI_REGISTRATIONS" in os.environ
        with pytest.warns(UnexportableBackendWarning, match="over 60"):
            register_backend(E.CUSTOM, "collections.OrderedDict")
        assert "ATTN_DI_REGISTRATIONS" not in os.environ
        assert subprocess.run(["true"], check=False).returncode == 0
    finally:
        attn_di.set_auto_propagation(previous)


def test_unknown_attn_di_backend_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name in ATTN_DI_BACKEND: the hint names the variable and suggests the name."""
    monkeypatch.setenv("ATTN_DI_BACKEND", "torch_spda")
    with pytest.raises(UnknownBackendError) as caught:
        select_backend({"head_size": 64, "dtype": "float32"}, device="cpu")
    assert "ATTN_DI_BACKEND='torch_spda'" in str(caught.value.hint)
    assert "did you mean 'TORCH_SDPA'?" in str(caught.value.hint)


def test_select_backend_takes_device_and_backend_from_a_mapping() -> None:
    """The keys container.attention takes (device, backend) work in a mapping too."""
    selection = select_backend(
        {"head_size": 64, "dtype": "bf16", "device": "cpu", "backend": "torch-sdpa"}
    )
    assert selection.backend is E.TORCH_SDPA


def test_a_dtype_prefix_suggests_its_only_completion() -> None:
    """'bfloat' suggests bfloat16 (spelling distance alone would say float32)."""
    with pytest.raises(ValueError, match="unknown dtype") as caught:
        select_backend({"head_size": 64, "dtype": "bfloat"}, device="cpu")
    assert caught.value.hint == "did you mean 'bfloat16'?"  # type: ignore[attr-defined]


def test_a_snapshot_key_with_an_empty_family_is_refused() -> None:
    """':CUSTOM' is neither an attention name nor a family's: refused, nothing applied."""
    with pytest.raises(ValueError, match="unknown family"):
        BackendContainer().apply_registrations({":CUSTOM": "a.B"})
