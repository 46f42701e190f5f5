"""The process-wide default container: :func:`get_container`, :func:`use_container`, and
:func:`register_backend`, which acts on it.

Above the container and selection layers; installs itself in :data:`attn_di._state.DEFAULT`
so that the enum members' methods (a lower layer) reach the default container.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, overload

from attn_di import _container, _state
from attn_di._provider import BackendProvider
from attn_di.exceptions import InvalidBackendTypeError

if TYPE_CHECKING:
    from attn_di._container import BackendContainer, BackendKey

__all__ = ["get_container", "register_backend", "registry_version", "use_container"]

_C = TypeVar("_C")

# The default is the innermost container installed by use_container, else the base one.
_base: BackendContainer | None = None
_installed: list[BackendContainer] = []
_lock = threading.Lock()


def get_container() -> BackendContainer:
    """The process-wide default container, created on first use.

    The enum's methods (``get_class``, ``get_path``, ...) and :func:`register_backend` act on it.
    """
    container: BackendContainer | None = _state.DEFAULT.current
    if container is None:
        with _lock:
            container = _state.DEFAULT.current or _set_default(_base_container())
        _state.notify_registrations_changed(container)  # runtime members made before it
    return container


def registry_version() -> Hashable:
    """A token that changes whenever what a member resolves to may have changed here.

    It changes with every registration, runtime member, override block (global or, in this
    thread / asyncio task, local), dependency-injector override and default container
    (:func:`use_container`). Equal tokens mean every member resolves as before, so a cache of
    resolutions (another project's selector, for instance) can key on it. Cheap: no lock,
    no copy.
    """
    container = _state.DEFAULT.current
    serial = None if container is None else container._serial
    return (serial, _state.GENERATION[0], _state.LOCAL_LAYERS.get())


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
    try:
        _move_wiring(previous, current)
        _state.notify_registrations_changed(current)
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
        _state.notify_registrations_changed(restored)


@overload
def register_backend(
    backend: BackendKey | BackendProvider,
    class_path: None = None,
    is_mamba: bool = False,
    *,
    container: BackendContainer | None = None,
) -> Callable[[type[_C]], type[_C]]: ...
@overload
def register_backend(
    backend: BackendKey | BackendProvider,
    class_path: str | type[Any],
    is_mamba: bool = False,
    *,
    container: BackendContainer | None = None,
) -> Callable[[_C], _C]: ...
def register_backend(
    backend: BackendKey | BackendProvider,
    class_path: str | type[Any] | None = None,
    is_mamba: bool = False,
    *,
    container: BackendContainer | None = None,
) -> Callable[[Any], Any]:
    """Register a backend class for a member, directly or as a class decorator.

    vLLM's signature (``vllm/v1/attention/backends/registry.py``, 0.33), so every call shape
    of published plugins works: ``register_backend(AttentionBackendEnum.CUSTOM,
    "my_pkg.attn.MyBackend")`` registers a path (imported lazily);
    ``register_backend(backend=..., class_path=..., is_mamba=False)`` the same by keyword;
    ``@register_backend(AttentionBackendEnum.CUSTOM)`` and
    ``register_backend(AttentionBackendEnum.CUSTOM, None)(MyBackend)`` register the class
    (also one defined inside a function) and return it unchanged. A member of
    :class:`MambaAttentionBackendEnum` registers there. A new name
    (``register_backend("MY_BACKEND", path)``; with ``is_mamba=True`` in the Mamba enum)
    creates a process-wide runtime member valued by the path and records the registration, so
    ``is_overridden()`` is True and ``clear_override()`` returns to the value, as in vLLM >=
    0.32. The last registration wins; ``clear_override()`` undoes it.

    Args:
        backend: a member of either enum, its exact name, a new member's name, or a provider
            (``BackendContainer.CUSTOM``).
        class_path: a dotted path (``pkg.mod.Class`` or ``pkg.mod:Class``), a class, or None
            to get a decorator.
        is_mamba: a string ``backend`` names a :class:`MambaAttentionBackendEnum` member.
        container: the container to register in (keyword only, attn_di's addition); the
            default container if None.

    Returns:
        The decorator; for a direct call, an identity function (as vLLM returns).

    Raises:
        InvalidBackendNameError: a new name that is refused ("Invalid or reserved backend
            name").
        InvalidBackendTypeError: ``class_path`` (or the decorated object) is not a class or a
            string; ``container`` is not a container.
        InvalidClassPathError: a malformed path. On any error nothing changes.
    """
    if container is not None and not isinstance(container, _container.BackendContainer):
        raise InvalidBackendTypeError("container", container, "a BackendContainer instance")
    if not isinstance(is_mamba, bool):
        raise InvalidBackendTypeError(
            "is_mamba",
            is_mamba,
            "True or False",
            hint="pass the container by keyword: register_backend(..., container=container)"
            if isinstance(is_mamba, _container.BackendContainer)
            else "is_mamba=True names a MambaAttentionBackendEnum member by string",
        )
    target = container if container is not None else get_container()
    if class_path is None:
        return target.register(backend, is_mamba=is_mamba)
    return target.register(backend, class_path, is_mamba=is_mamba)


def _base_container() -> BackendContainer:
    global _base
    if _base is None:
        _base = _container.BackendContainer()
    return _base


def _set_default(container: BackendContainer) -> BackendContainer:
    _state.DEFAULT.current = container
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


_state.DEFAULT.get = get_container


def _candidates(device: Any, config: Any) -> Any:
    from attn_di._selection import default_candidates  # on first use: import attn_di stays light

    return default_candidates(device, config)


def _select(container: Any, settings: Any) -> Any:
    from attn_di._selection import select_from_settings

    return select_from_settings(container, settings)


_container.SELECTION_HOOKS.update(candidates=_candidates, select=_select)
