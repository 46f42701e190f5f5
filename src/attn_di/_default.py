"""The process-wide default container: :func:`get_container`, :func:`use_container`, and
:func:`register_backend`, which acts on it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, overload

from attn_di import _container  # a module reference: _container and _enum import each other
from attn_di.exceptions import InvalidBackendTypeError

if TYPE_CHECKING:
    from attn_di._container import BackendContainer, BackendKey

__all__ = ["get_container", "register_backend", "use_container"]

_C = TypeVar("_C")

# The default is the innermost container installed by use_container, else the base one.
_default: BackendContainer | None = None
_base: BackendContainer | None = None
_installed: list[BackendContainer] = []
_lock = threading.Lock()


def get_container() -> BackendContainer:
    """The process-wide default container, created on first use.

    The enum's methods (``get_class``, ``get_path``, ...) and :func:`register_backend` act on it.
    """
    container = _default
    if container is None:
        with _lock:
            container = _default or _set_default(_base_container())
    return container


@contextmanager
def use_container(container: BackendContainer | None = None) -> Iterator[BackendContainer]:
    """Install ``container`` (a fresh one by default) as the default until the block ends.

    Modules wired to the previous default are wired to it for the block and back after, so
    ``@inject`` functions follow. Blocks may exit out of order: the default is always the
    innermost block still open. Meant for tests.

    Raises:
        InvalidBackendTypeError: ``container`` is not a BackendContainer instance.
    """
    if container is not None and not isinstance(container, _container.BackendContainer):
        raise InvalidBackendTypeError(
            "container", container, "a BackendContainer instance", hint="use BackendContainer()"
        )
    current = container if container is not None else _container.BackendContainer()
    previous = get_container()
    with _lock:
        _installed.append(current)
        _set_default(current)
    _move_wiring(previous, current)
    try:
        yield current
    finally:
        with _lock:
            was_innermost = _installed[-1] is current
            for index in range(len(_installed) - 1, -1, -1):
                if _installed[index] is current:
                    del _installed[index]
                    break
            restored = _set_default(_installed[-1] if _installed else _base_container())
        if was_innermost:
            _move_wiring(current, restored)


@overload
def register_backend(
    member: BackendKey, class_path: None = None, *, container: BackendContainer | None = None
) -> Callable[[type[_C]], type[_C]]: ...
@overload
def register_backend(
    member: BackendKey, class_path: str | type[Any], *, container: BackendContainer | None = None
) -> Callable[[_C], _C]: ...
def register_backend(
    member: BackendKey,
    class_path: str | type[Any] | None = None,
    *,
    container: BackendContainer | None = None,
) -> Callable[[Any], Any]:
    """Register a backend class for a member, directly or as a class decorator.

    ``register_backend(AttentionBackendEnum.CUSTOM, "my_pkg.attn.MyBackend")`` registers a
    path (imported lazily); ``@register_backend(AttentionBackendEnum.CUSTOM)`` registers the
    decorated class (also one defined inside a function) and returns it unchanged. A new
    upper-case name (``register_backend("MY_BACKEND", ...)``) adds a runtime member, for the
    whole process, whose default is the given class; a name very close to an existing member
    is refused as a likely typo (use ``AttentionBackendEnum.register`` for such names). The
    last registration wins; ``clear_override()`` undoes it.

    Args:
        member: a member or its exact name (or a new member's name).
        class_path: a dotted path (``pkg.mod.Class`` or ``pkg.mod:Class``), a class, or None
            to get a decorator.
        container: the container to register in (keyword only); the default container if None.

    Returns:
        The decorator; for a direct call, an identity function (as vLLM returns).

    Raises:
        UnknownBackendError: a new name that looks like a typo of a member.
        InvalidBackendNameError: a new name that is refused.
        InvalidBackendTypeError: ``class_path`` (or the decorated object) is not a class or a
            string; ``container`` is not a container.
        InvalidClassPathError: a malformed path. On any error nothing changes.
    """
    if container is not None and not isinstance(container, _container.BackendContainer):
        raise InvalidBackendTypeError("container", container, "a BackendContainer instance")
    target = container if container is not None else get_container()
    if class_path is None:
        return target.register(member)
    return target.register(member, class_path)


def _base_container() -> BackendContainer:
    global _base
    if _base is None:
        _base = _container.BackendContainer()
    return _base


def _set_default(container: BackendContainer) -> BackendContainer:
    global _default
    _default = container
    return container


def _move_wiring(source: BackendContainer, target: BackendContainer) -> None:
    """Wire ``target`` to the modules and packages ``source`` is wired to (replacing it there)."""
    modules, packages = list(source.wired_to_modules), list(source.wired_to_packages)
    if source is target or not (modules or packages):
        return
    target.wire(modules=modules, packages=packages, warn_unresolved=source._warn_unresolved)
    target.wired_to_modules[:] = list(dict.fromkeys(target.wired_to_modules))
    target.wired_to_packages[:] = list(dict.fromkeys(target.wired_to_packages))
    source.wired_to_modules.clear()
    source.wired_to_packages.clear()
