"""Resolution stays correct while another thread registers and clears."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

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
