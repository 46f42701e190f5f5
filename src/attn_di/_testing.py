"""Test isolation for backends, without pytest: what attn_di's pytest plugin builds on.

:func:`isolated_backends` gives a block a fresh default container, a clean ``ATTN_DI_*``
environment and a fresh plugin state, then undoes everything the block left behind and
says what leaked. :class:`OverrideBackendFixture` is the ``override_backend`` fixture.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from attn_di._container import BackendContainer, BackendKey
from attn_di._default import use_container
from attn_di._family import BackendEnum, families
from attn_di._overrides import BackendOverride, ContainerOverride
from attn_di._plugins import isolated_plugin_state
from attn_di._propagation import swap_auto_propagation
from attn_di._state import LOCAL_LAYERS, REGISTRY_LOCK

__all__ = ["ENV_PREFIX", "Isolation", "OverrideBackendFixture", "isolated_backends"]

ENV_PREFIX = "ATTN_DI_"
_MISSING: Any = object()


class OverrideBackendFixture:
    """The type of the ``override_backend`` pytest fixture (for annotations).

    Calling it overrides like ``container.override(...)``; every override made through it
    is restored when the test ends, so nothing leaks::

        def test_engine(override_backend: OverrideBackendFixture) -> None:
            override_backend(AttentionBackendEnum.TRITON_ATTN, FakeBackend)
            override_backend({AttentionBackendEnum.CUSTOM: "my_pkg.Backend"}, local=True)

    Attributes:
        container: the test's default container, which the overrides apply to.
    """

    def __init__(self, container: BackendContainer) -> None:
        self.container = container
        self._handles: list[BackendOverride | ContainerOverride] = []

    def __call__(
        self,
        member: BackendKey | Mapping[Any, Any],
        impl: Any = _MISSING,
        *,
        local: bool = False,
    ) -> BackendOverride | ContainerOverride:
        """Override ``member`` with ``impl`` (or a mapping ``{member: impl}``) until the test ends.

        Returns:
            The override's handle: ``.restore()`` ends it early.

        Raises:
            UnknownBackendError, InvalidBackendTypeError, InvalidClassPathError: nothing changes.
        """
        if impl is _MISSING:
            handle = self.container.override(member, local=local)
        else:
            handle = self.container.override(member, impl, local=local)
        self._handles.append(handle)
        return handle

    def stopall(self) -> None:
        """Restore every override made through this fixture, newest first."""
        while self._handles:
            self._handles.pop().restore()

    def __repr__(self) -> str:
        active = [handle for handle in self._handles if handle.active]
        return f"<OverrideBackendFixture active={active}>"


class Isolation:
    """What :func:`isolated_backends` yields.

    Attributes:
        container: the block's default container.
        leaks: set on exit: one line per override layer the block left active.
    """

    def __init__(self, container: BackendContainer) -> None:
        self.container = container
        self.leaks: list[str] = []

    def leak_report(self) -> str:
        """The failure message for :attr:`leaks` (with a hint)."""
        return (
            "the test leaked override layers: "
            + "; ".join(self.leaks)
            + "\nHint: use `with container.override(...):`, call `.restore()` on the handle, "
            "or override through the `override_backend` fixture"
        )


@contextmanager
def isolated_backends() -> Iterator[Isolation]:
    """A fresh default container, ``ATTN_DI_*`` environment and plugin state for a block.

    On exit: leaked override layers (global on the block's container, or context-local)
    are removed and listed in ``Isolation.leaks``; runtime members added in the block are
    removed; the environment, the previous default container and the plugin state come back.

    Automatic propagation (``ATTN_DI_REGISTRATIONS`` following every registration) is off in
    the block, so tests may register classes defined in test functions and start
    subprocesses with a clean environment; call ``attn_di.set_auto_propagation(True)`` in a
    test that wants it (it is restored on exit).
    """
    saved_env = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
    for name in saved_env:
        del os.environ[name]
    auto_before = swap_auto_propagation(False)
    local_before = LOCAL_LAYERS.get()
    runtime_before = {m for family in families() for m in family.runtime_members()}
    isolation: Isolation | None = None
    try:
        with isolated_plugin_state(), use_container() as container:
            isolation = Isolation(container)
            yield isolation
            leaked = container.active_overrides()
            if leaked:
                isolation.leaks.append(f"global overrides of {[m.name for m in leaked]}")
                _remove_layers(container, leaked)
            local_after = LOCAL_LAYERS.get()
            added = [lay for lay in local_after if lay not in local_before and lay.alive]
            if added:
                names = sorted({provider.name for layer in added for provider in layer.targets})
                isolation.leaks.append(f"context-local overrides of {names}")
    finally:
        LOCAL_LAYERS.set(local_before)
        for family in families():
            for member in family.runtime_members():
                if member not in runtime_before:
                    family.remove_member(member)
        for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
            del os.environ[name]
        os.environ.update(saved_env)
        swap_auto_propagation(auto_before)


def _remove_layers(container: BackendContainer, members: list[BackendEnum]) -> None:
    with REGISTRY_LOCK:
        for member in members:
            provider = container.provider(member)
            provider._layers = []
            provider.invalidate()
