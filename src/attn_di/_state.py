"""Shared registry state, at the bottom of the core: one lock, a generation counter, the
context-local override layers, and the cells through which higher layers hook in.

Nothing here imports another attn_di module. Higher modules install their hooks at import
(the default container's getter, listeners of registration changes), so the core's imports
run one way: names -> providers -> container -> selection -> default container -> facade.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = [
    "DEFAULT",
    "GENERATION",
    "LOCAL_LAYERS",
    "PROPAGATION",
    "REGISTRY_LOCK",
    "DefaultCell",
    "notify_quietly",
    "notify_registrations_changed",
    "on_registrations_changed",
    "snapshot",
    "user_stacklevel",
]

_T = TypeVar("_T")

REGISTRY_LOCK = threading.RLock()
"""Held by every change to the registry: member tables, registrations, override layers.

Readers never take it on the fast path. Nothing imports while holding it."""

GENERATION = [0]
"""Bumped by every change to any provider's state: selection caches key on it."""

LOCAL_LAYERS: ContextVar[tuple[Any, ...]] = ContextVar("attn_di_local_layers", default=())
"""The context-local override layers (this thread / asyncio task), oldest first."""


class DefaultCell:
    """Where the default container is found: ``current`` (None before the first use) and
    ``get`` (creates it), both installed by :mod:`attn_di._default`."""

    __slots__ = ("current", "get")

    def __init__(self) -> None:
        self.current: Any = None
        self.get: Callable[[], Any] = _not_installed


def _not_installed() -> Any:  # pragma: no cover - attn_di/__init__ installs the real getter
    raise RuntimeError("attn_di._default is not imported; import attn_di first")


DEFAULT = DefaultCell()


class PropagationCell:
    """Why changes of a container would not reach new processes: ``refusal(container)``
    gives the reason, or None when they would (installed by :mod:`attn_di._propagation`;
    asked by ``override(..., propagate=True)``)."""

    __slots__ = ("refusal",)

    def __init__(self) -> None:
        self.refusal: Callable[[Any], str | None] = _no_propagation


def _no_propagation(container: Any) -> str | None:  # pragma: no cover - replaced at import
    return "attn_di._propagation is not imported; import attn_di first"


PROPAGATION = PropagationCell()

_listeners: list[Callable[[Any], None]] = []


def on_registrations_changed(listener: Callable[[Any], None]) -> None:
    """Call ``listener(container)`` after every change of what a container would export
    (registrations, runtime members; ``container`` is None for process-wide changes)."""
    _listeners.append(listener)


def notify_registrations_changed(container: Any) -> None:
    """Tell the listeners of :func:`on_registrations_changed` (called outside the lock)."""
    for listener in list(_listeners):
        listener(container)


def snapshot(copy: Callable[[], _T]) -> _T:
    """``copy()``, a one-call copy of a table other threads change (``tuple(dict)``), retried
    if the table changed meanwhile. Copying is one C call, but a garbage collection during it
    can run Python code (weakref callbacks) and so let another thread in, which makes the copy
    raise ``RuntimeError: dictionary changed size during iteration``."""
    while True:
        try:
            return copy()
        except RuntimeError:
            continue


def notify_quietly(container: Any) -> None:
    """:func:`notify_registrations_changed` after a rollback. Listeners write before they
    warn, so an error a warning filter raises there (for the state being returned to, which
    was warned about before) is dropped: the rollback's own error is the one to report."""
    with contextlib.suppress(Exception):
        notify_registrations_changed(container)


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first frame outside attn_di (the user's call)."""
    package = __file__.rpartition("/")[0]
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
