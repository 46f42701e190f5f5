"""Context-local overrides: one thread or asyncio task at a time."""

from __future__ import annotations

import asyncio
import threading

from attn_di import AttentionBackendEnum, BackendContainer

TRITON = AttentionBackendEnum.TRITON_ATTN


class FakeA:
    """A stand-in backend."""


class FakeB:
    """Another stand-in backend."""


def test_local_override_is_invisible_to_other_threads(container: BackendContainer) -> None:
    """Another thread keeps seeing the default while this one sees its local override."""
    seen: list[str] = []
    with container.override(TRITON, FakeA, local=True) as handle:
        assert handle.local
        assert container.backend(TRITON) is FakeA
        assert container.source(TRITON) == "local override"
        worker = threading.Thread(target=lambda: seen.append(container.get_path(TRITON)))
        worker.start()
        worker.join()
    assert seen == [TRITON.value]
    assert not TRITON.is_overridden()


def test_local_wins_over_global(container: BackendContainer) -> None:
    """A local layer takes precedence over a global layer."""
    with container.override(TRITON, FakeA), container.override(TRITON, FakeB, local=True):
        assert container.backend(TRITON) is FakeB
        assert TRITON.get_class() is FakeB
    assert not TRITON.is_overridden()


def test_two_asyncio_tasks_with_different_local_overrides(container: BackendContainer) -> None:
    """Concurrent tasks each resolve their own local override, interleaved."""

    async def run(impl: type, steps: int) -> list[type]:
        seen = []
        with container.override(TRITON, impl, local=True):
            for _ in range(steps):
                seen.append(container.backend(TRITON))
                await asyncio.sleep(0)
        return seen

    async def main() -> tuple[list[type], list[type]]:
        return await asyncio.gather(run(FakeA, 5), run(FakeB, 5))

    seen_a, seen_b = asyncio.run(main())
    assert seen_a == [FakeA] * 5
    assert seen_b == [FakeB] * 5
    assert not TRITON.is_overridden()


def test_local_out_of_order_exits(container: BackendContainer) -> None:
    """Local layers, too, remove only themselves."""
    outer = container.override(TRITON, FakeA, local=True)
    inner = container.override(TRITON, FakeB, local=True)
    outer.restore()
    assert container.backend(TRITON) is FakeB
    inner.restore()
    assert not TRITON.is_overridden()
