"""``BackendContainer``: a dependency-injector container with one lazy provider per member.

Also the process-wide default container (:func:`get_container`, :func:`use_container`) and
:func:`register_backend`, which act on it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from dependency_injector import containers

from attn_di._enum import (
    AttentionBackendEnum,
    add_runtime_member,
    check_new_name,
    lookup_member,
    on_new_member,
    on_removed_member,
)
from attn_di._overrides import BackendOverride, override_target
from attn_di._paths import check_class_path, resolves_to
from attn_di._provider import LOCAL_LAYERS, STATE_LOCK, BackendProvider, Layer, Target
from attn_di.exceptions import (
    InvalidBackendTypeError,
    UnexportableBackendError,
    UnknownBackendError,
)

__all__ = [
    "BackendContainer",
    "BackendKey",
    "get_container",
    "register_backend",
    "use_container",
]

BackendKey = AttentionBackendEnum | str
"""A member, or a member's exact name."""

_C = TypeVar("_C")
_MISSING: Any = object()
_live_containers: weakref.WeakSet[_ContainerAPI] = weakref.WeakSet()


class _ContainerAPI:
    """The methods of a :class:`BackendContainer` instance."""

    providers: dict[str, Any]
    wired_to_modules: list[Any]
    wired_to_packages: list[Any]
    _by_key: dict[object, BackendProvider]
    _resolved: dict[object, type[Any]]
    _warn_unresolved: bool

    # -- resolving --------------------------------------------------------------------
    def backend(self, member: BackendKey) -> type[Any]:
        """The backend class for ``member`` (a member or its name), imported on first use.

        Raises:
            UnknownBackendError: no such member (lists the valid names, suggests one).
            BackendNotRegisteredError: the member has no path (CUSTOM before registration).
            BackendImportError: its path does not import.
        """
        if not LOCAL_LAYERS.get():
            try:
                return self._resolved[member]
            except (KeyError, TypeError):
                pass
        provider = self.provider(member)
        if provider.overridden:
            return cast("type[Any]", provider())
        return cast("type[Any]", provider.resolve())

    def provider(self, member: BackendKey) -> BackendProvider:
        """The :class:`BackendProvider` of ``member`` in this container.

        Raises:
            UnknownBackendError: no such member.
        """
        try:
            return self._by_key[member]
        except (KeyError, TypeError):
            lookup_member(member)  # raises the helpful error for names
            raise UnknownBackendError(member, list(AttentionBackendEnum.__members__)) from None

    def get_path(self, member: BackendKey, include_classname: bool = True) -> str:
        """The class path ``member`` resolves to here; see :meth:`AttentionBackendEnum.get_path`."""
        return self.provider(member).get_path(include_classname)

    def is_overridden(self, member: BackendKey) -> bool:
        """True while a registration or an override of ``member`` is active here."""
        return self.provider(member).is_overridden()

    def source(self, member: BackendKey) -> str:
        """Where ``member``'s class comes from: "local override", "override", "registered",
        "default", "di override" (dependency-injector's own), or "unset" (CUSTOM)."""
        return self.provider(member).source()

    # -- registrations ----------------------------------------------------------------
    @overload
    def register(self, member: BackendKey) -> Callable[[type[_C]], type[_C]]: ...
    @overload
    def register(self, member: BackendKey, class_path: str | type[Any]) -> Callable[[_C], _C]: ...
    def register(self, member: BackendKey, class_path: Any = None) -> Callable[[Any], Any]:
        """Register a class for ``member`` here; see :func:`register_backend`."""
        _check_key_or_new_name(member)
        if class_path is None:

            def decorator(backend_cls: type[_C]) -> type[_C]:
                if not isinstance(backend_cls, type):
                    raise InvalidBackendTypeError(
                        "backend_cls", backend_cls, "a class (use register_backend as @decorator)"
                    )
                self._register(member, Target.of_object(backend_cls, "registered"))
                return backend_cls

            return decorator
        self._register(member, _registration_target(class_path))
        return _identity

    def clear_override(self, member: BackendKey) -> None:
        """Forget ``member``'s registration here (no-op if none); override blocks are untouched."""
        provider = self.provider(member)
        with STATE_LOCK:
            provider.set_registration(None)

    def export_registrations(self) -> dict[str, str]:
        """A JSON-serialisable snapshot ``{member name: dotted path}`` of the registrations.

        Runtime members are included (with their registered or default path), so that
        :meth:`apply_registrations` can recreate them in another process. Override blocks are
        scoped and never exported.

        Raises:
            UnexportableBackendError: a registered class whose ``module.qualname`` does not
                import back to it (e.g. defined inside a function).
        """
        snapshot: dict[str, str] = {}
        for name, provider in self._providers_by_name().items():
            target = provider._registered
            if target is None and name in _BUILTIN_NAMES:
                continue
            target = target or provider._default
            if target is None:
                continue
            if target.has_object and not resolves_to(target.path, target.load(name)):
                raise UnexportableBackendError(
                    name, target.path, "does not import back to the same class in a new process"
                )
            snapshot[name] = target.path
        return snapshot

    def apply_registrations(self, snapshot: Mapping[str, str]) -> None:
        """Apply a snapshot made by :meth:`export_registrations` (e.g. in a worker process).

        Unknown names become runtime members. Everything is validated first: on error nothing
        changes.

        Raises:
            InvalidBackendTypeError: not a mapping of strings to strings.
            InvalidBackendNameError: a new name that is refused.
            InvalidClassPathError: a malformed path.
        """
        if not isinstance(snapshot, Mapping):
            raise InvalidBackendTypeError("snapshot", snapshot, "a mapping {name: class path}")
        for name, class_path in snapshot.items():
            if not isinstance(class_path, str):
                raise InvalidBackendTypeError(f"snapshot[{name!r}]", class_path, "a class path")
            check_class_path(class_path)
            _check_key_or_new_name(name)
        for name, class_path in snapshot.items():
            if name in AttentionBackendEnum.__members__:
                self._register(name, Target.of_path(class_path, "registered"))
            else:
                AttentionBackendEnum.register(name, class_path)

    # -- overrides --------------------------------------------------------------------
    def override(
        self, member: Any, impl: Any = _MISSING, *, local: bool = False
    ) -> BackendOverride:
        """Override backends, at once, until the returned handle is exited or restored.

        ``with container.override(AttentionBackendEnum.TRITON_ATTN, FakeBackend):`` or
        ``container.override({member: impl, ...})``. The override is a layer above the
        registrations: on exit exactly this layer is removed (also on an exception and when
        blocks exit out of order); registrations made inside the block are kept.

        Args:
            member: a member or its name, or a mapping ``{member: impl}``. A dependency-injector
                container is passed to dependency-injector's own container override.
            impl: a class, a dotted class path, or any callable object (e.g. a
                ``mocker.Mock(spec=...)``), returned as is by resolution.
            local: visible only in the current thread / asyncio task (a ContextVar).

        Raises:
            UnknownBackendError, InvalidBackendTypeError, InvalidClassPathError: nothing changes.
        """
        if impl is not _MISSING:
            if isinstance(member, Mapping):
                raise InvalidBackendTypeError("impl", impl, "omitted when a mapping is given")
            requested: Iterable[tuple[Any, Any]] = ((member, impl),)
        elif isinstance(member, Mapping):
            requested = member.items()
        elif containers.is_container(member):
            containers.DynamicContainer.override(self, member)  # type: ignore[arg-type]
            return BackendOverride(Layer({}, False), {})
        else:
            raise InvalidBackendTypeError("impl", None, "given (the class to use)")
        targets: dict[BackendProvider, Target] = {}
        impls: dict[AttentionBackendEnum, Any] = {}
        for key, value in requested:
            provider = self.provider(key)
            targets[provider] = override_target(value, local=local)
            impls[provider.member] = value
        handle = BackendOverride(Layer(targets, local), impls)
        handle.apply()
        return handle

    def active_overrides(self) -> list[AttentionBackendEnum]:
        """Members with a global override layer active here (used to catch leaks in tests)."""
        return [p.member for p in self._providers_by_name().values() if p._layers]

    # -- wiring -----------------------------------------------------------------------
    def wire(
        self,
        modules: Any = None,
        packages: Any = None,
        from_package: str | None = None,
        keep_cache: bool | None = None,
        warn_unresolved: bool = False,
    ) -> None:
        """dependency-injector's ``wire``; remembers ``warn_unresolved`` for use_container."""
        self._warn_unresolved = warn_unresolved
        containers.DynamicContainer.wire(
            self,  # type: ignore[arg-type]
            modules=modules,
            packages=packages,
            from_package=from_package,
            keep_cache=keep_cache,
            warn_unresolved=warn_unresolved,
        )

    # -- internals --------------------------------------------------------------------
    def _register(self, member: BackendKey, target: Target) -> None:
        if isinstance(member, str) and member not in AttentionBackendEnum.__members__:
            add_runtime_member(
                member, target.path, target.load(member) if target.has_object else None
            )
            return
        provider = self.provider(member)
        with STATE_LOCK:
            provider.set_registration(target)

    def _providers_by_name(self) -> dict[str, BackendProvider]:
        return {p.name: p for p in self._by_key.values()}

    def __repr__(self) -> str:
        by_name = self._providers_by_name()
        registered = [n for n, p in by_name.items() if p._registered is not None]
        overridden = [n for n, p in by_name.items() if p._layers]
        return (
            f"<BackendContainer members={len(by_name)} registered={registered} "
            f"overridden={overridden}>"
        )


class _BackendContainerInstance(_ContainerAPI, containers.DynamicContainer):  # type: ignore[misc]
    """The type of ``BackendContainer()`` instances (dependency-injector makes a copy)."""

    def __init__(self) -> None:
        self._by_key = {}
        self._resolved = {}
        self._warn_unresolved = False
        super().__init__()
        _live_containers.add(self)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if isinstance(value, BackendProvider):
            self._by_key[value.member] = value
            self._by_key[value.name] = value
            value.attach(self._resolved)


if TYPE_CHECKING:
    _DeclarativeMeta = type

    class _DeclarativeBase(  # type: ignore[misc]
        _ContainerAPI, containers.DeclarativeContainer
    ):
        pass

else:
    _DeclarativeMeta = type(containers.DeclarativeContainer)
    _DeclarativeBase = containers.DeclarativeContainer


class _BackendContainerMeta(_DeclarativeMeta):
    def __instancecheck__(self, instance: object) -> bool:
        # ``BackendContainer()`` returns a copy of another type: make isinstance() say yes.
        if self is BackendContainer and isinstance(instance, _BackendContainerInstance):
            return True
        return super().__instancecheck__(instance)


class BackendContainer(_DeclarativeBase, metaclass=_BackendContainerMeta):
    """One lazy :class:`BackendProvider` per :class:`AttentionBackendEnum` member.

    ``Provide[BackendContainer.TRITON_ATTN]`` injects the member's class; nothing is imported
    until a provider is called. Runtime members get a provider here and in every live
    instance. Each instance has its own registrations and overrides.

    Example::

        container = BackendContainer()
        backend_cls = container.backend(AttentionBackendEnum.CPU_ATTN)
        with container.override(AttentionBackendEnum.CPU_ATTN, MyBackend):
            assert container.backend("CPU_ATTN") is MyBackend
    """

    instance_type = _BackendContainerInstance

    FLASH_ATTN = BackendProvider(AttentionBackendEnum.FLASH_ATTN)
    FLASH_SINK_ATTN = BackendProvider(AttentionBackendEnum.FLASH_SINK_ATTN)
    TRITON_ATTN = BackendProvider(AttentionBackendEnum.TRITON_ATTN)
    XFORMERS = BackendProvider(AttentionBackendEnum.XFORMERS)
    ROCM_ATTN = BackendProvider(AttentionBackendEnum.ROCM_ATTN)
    ROCM_AITER_MLA = BackendProvider(AttentionBackendEnum.ROCM_AITER_MLA)
    ROCM_AITER_FA = BackendProvider(AttentionBackendEnum.ROCM_AITER_FA)
    TORCH_SDPA = BackendProvider(AttentionBackendEnum.TORCH_SDPA)
    FLASHINFER = BackendProvider(AttentionBackendEnum.FLASHINFER)
    FLASHINFER_MLA = BackendProvider(AttentionBackendEnum.FLASHINFER_MLA)
    TRITON_MLA = BackendProvider(AttentionBackendEnum.TRITON_MLA)
    CUTLASS_MLA = BackendProvider(AttentionBackendEnum.CUTLASS_MLA)
    FLASHMLA = BackendProvider(AttentionBackendEnum.FLASHMLA)
    FLASHMLA_SPARSE = BackendProvider(AttentionBackendEnum.FLASHMLA_SPARSE)
    FLASH_ATTN_MLA = BackendProvider(AttentionBackendEnum.FLASH_ATTN_MLA)
    PALLAS = BackendProvider(AttentionBackendEnum.PALLAS)
    IPEX = BackendProvider(AttentionBackendEnum.IPEX)
    NO_ATTENTION = BackendProvider(AttentionBackendEnum.NO_ATTENTION)
    FLEX_ATTENTION = BackendProvider(AttentionBackendEnum.FLEX_ATTENTION)
    TREE_ATTN = BackendProvider(AttentionBackendEnum.TREE_ATTN)
    ROCM_AITER_UNIFIED_ATTN = BackendProvider(AttentionBackendEnum.ROCM_AITER_UNIFIED_ATTN)
    CPU_ATTN = BackendProvider(AttentionBackendEnum.CPU_ATTN)
    CUSTOM = BackendProvider(AttentionBackendEnum.CUSTOM)


_BUILTIN_NAMES = frozenset(AttentionBackendEnum.__members__)


def _add_runtime_provider(member: AttentionBackendEnum) -> None:
    setattr(BackendContainer, member.name, BackendProvider(member))
    for container in list(_live_containers):
        setattr(container, member.name, BackendProvider(member))


def _remove_runtime_provider(member: AttentionBackendEnum) -> None:
    delattr(BackendContainer, member.name)
    for container in list(_live_containers):
        provider = container._by_key.pop(member, None)
        container._by_key.pop(member.name, None)
        if provider is not None:
            with STATE_LOCK:
                provider.invalidate()
            delattr(container, member.name)


on_new_member(_add_runtime_provider)
on_removed_member(_remove_runtime_provider)


# -- the default container ------------------------------------------------------------
_default: BackendContainer | None = None
_default_lock = threading.Lock()


def get_container() -> BackendContainer:
    """The process-wide default container, created on first use.

    The enum's methods (``get_class``, ``get_path``, ...) and :func:`register_backend` act on it.
    """
    container = _default
    if container is None:
        with _default_lock:
            container = _default
            if container is None:
                container = _set_default(BackendContainer())
    return container


@contextmanager
def use_container(container: BackendContainer | None = None) -> Iterator[BackendContainer]:
    """Install ``container`` (a fresh one by default) as the default until the block ends.

    Modules wired to the previous default are wired to it for the block and back after,
    so ``@inject`` functions follow. Meant for tests.
    """
    previous = get_container()
    current = container if container is not None else BackendContainer()
    modules, packages = list(previous.wired_to_modules), list(previous.wired_to_packages)
    with _default_lock:
        _set_default(current)
    if modules or packages:
        current.wire(modules=modules, packages=packages, warn_unresolved=previous._warn_unresolved)
    try:
        yield current
    finally:
        with _default_lock:
            _set_default(previous)
        if modules or packages:
            previous.wire(
                modules=modules, packages=packages, warn_unresolved=previous._warn_unresolved
            )
            previous.wired_to_modules[:] = modules
            previous.wired_to_packages[:] = packages
            current.wired_to_modules.clear()
            current.wired_to_packages.clear()


def _set_default(container: BackendContainer) -> BackendContainer:
    global _default
    _default = container
    return container


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
    decorated class (also one defined inside a function) and returns it unchanged. A name
    that is not a member (``register_backend("MY_BACKEND", ...)``) adds a runtime member
    whose default is the given class. The last registration wins; ``clear_override()``
    undoes it.

    Args:
        member: a member or its exact name (or a new member's name).
        class_path: a dotted path (``pkg.mod.Class`` or ``pkg.mod:Class``), a class, or None
            to get a decorator.
        container: the container to register in (keyword only); the default container if None.

    Returns:
        The decorator; for a direct call, an identity function (as vLLM returns).

    Raises:
        UnknownBackendError: never; an unknown valid name creates a member.
        InvalidBackendNameError: a new name that is refused.
        InvalidBackendTypeError: ``class_path`` (or the decorated object) is not a class or a
            string.
        InvalidClassPathError: a malformed path. On any error nothing changes.
    """
    target = container if container is not None else get_container()
    if class_path is None:
        return target.register(member)
    return target.register(member, class_path)


def _registration_target(class_path: object) -> Target:
    if isinstance(class_path, str):
        return Target.of_path(check_class_path(class_path), "registered")
    if isinstance(class_path, type):
        return Target.of_object(class_path, "registered")
    raise InvalidBackendTypeError("class_path", class_path, "a dotted path string or a class")


def _check_key_or_new_name(member: object) -> None:
    if isinstance(member, AttentionBackendEnum):
        return
    if isinstance(member, str):
        if member not in AttentionBackendEnum.__members__:
            check_new_name(member)
        return
    raise InvalidBackendTypeError("member", member, "an AttentionBackendEnum member or a name")


def _identity(obj: _C) -> _C:
    return obj
