"""Resolution stays correct while another thread registers and clears."""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable

import pytest

from attn_di import AttentionBackendEnum, BackendContainer, register_backend

VALID = {collections.OrderedDict, collections.Counter, collections.deque}


def test_eight_readers_and_a_writer(
    container: BackendContainer, new_name: Callable[[], str]
) -> None:
    """8 threads resolve while one registers, clears and overrides: no error, results valid."""
    member = AttentionBackendEnum.register(new_name(), "collections.OrderedDict")
    stop = threading.Event()
    errors: list[BaseException] = []
    results: list[set[type]] = [set() for _ in range(8)]

    def read(index: int) -> None:
        try:
            while not stop.is_set():
                results[index].add(container.backend(member))
                results[index].add(member.get_class())
                results[index].add(container.backend(member.name))
        except BaseException as exc:
            errors.append(exc)

    def write() -> None:
        try:
            for step in range(3000):
                if step % 2:
                    member.clear_override()
                else:
                    register_backend(member, "collections.Counter")
                if step % 5 == 0:
                    with container.override(member, collections.deque):
                        pass
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    writer = threading.Thread(target=write)
    for thread in (*readers, writer):
        thread.start()
    for thread in (writer, *readers):
        thread.join(timeout=120)
    assert errors == []
    assert all(seen and seen <= VALID for seen in results)
    # Nothing stale was cached by a reader racing the writer's last change.
    assert container.backend(member) is collections.OrderedDict
    register_backend(member, "collections.Counter")
    assert member.get_class() is collections.Counter


def _register_at_once(name: str, paths: list[str], threads: int) -> list[BaseException]:
    """``threads`` threads released together each call register_backend(name, a path)."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def register(index: int) -> None:
        barrier.wait()
        try:
            register_backend(name, paths[index % len(paths)])
        except BaseException as exc:
            errors.append(exc)

    started = [threading.Thread(target=register, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    return errors


def test_threads_creating_one_new_member_all_succeed(
    container: BackendContainer, new_name: Callable[[], str]
) -> None:
    """16 threads released at once register one new name, round after round: every call
    succeeds, the member exists once, and its registration is one of the paths given (the
    last to take the registry lock); a later call still wins."""
    paths = ["collections.OrderedDict", "collections.Counter", "collections.deque"]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as the interpreter can
    try:
        for _ in range(20):
            name = new_name()
            assert _register_at_once(name, paths, 16) == []
            assert list(AttentionBackendEnum.__members__).count(name) == 1
            assert container.source(name) == "registered"
            assert container.get_path(name) in paths
    finally:
        sys.setswitchinterval(switch)
    register_backend(name, "collections.ChainMap")
    assert container.get_path(name) == "collections.ChainMap"


def test_a_module_another_thread_is_still_importing_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A class path's module that is in ``sys.modules`` but still initialising (another
    thread is importing it) goes through ``importlib.import_module``, which waits for that
    import, instead of being read half made ("has no attribute ..."); a finished one is used
    as it is."""
    import importlib
    import importlib.machinery
    import sys
    import types

    from attn_di import _paths

    half = types.ModuleType("attn_di_half_imported")
    half.__spec__ = importlib.machinery.ModuleSpec("attn_di_half_imported", None)
    half.__spec__._initializing = True  # type: ignore[attr-defined]
    done = types.ModuleType("attn_di_half_imported")
    done.Backend = object  # type: ignore[attr-defined]
    waited: list[str] = []

    def import_module(name: str) -> types.ModuleType:
        waited.append(name)
        return done

    monkeypatch.setitem(sys.modules, "attn_di_half_imported", half)
    monkeypatch.setattr(importlib, "import_module", import_module)
    assert _paths._import_module("attn_di_half_imported") is done
    assert waited == ["attn_di_half_imported"]
    half.__spec__._initializing = False  # type: ignore[attr-defined]
    assert _paths._import_module("attn_di_half_imported") is half
    assert waited == ["attn_di_half_imported"]
