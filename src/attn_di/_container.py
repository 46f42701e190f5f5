"""``BackendContainer``: a dependency-injector container with one lazy provider per member,
plus the selection providers (``attention``, ``candidates``, ``selection``, ``selected``).

The process-wide default container lives in :mod:`attn_di._default`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from dependency_injector import containers, providers

from attn_di._enum import (
    AttentionBackendEnum,
    add_runtime_member,
    check_new_name,
    on_new_member,
    on_removed_member,
)
from attn_di._overrides import BackendOverride, ContainerOverride, override_target
from attn_di._paths import check_class_path, resolves_to
from attn_di._provider import LOCAL_LAYERS, STATE_LOCK, BackendProvider, Layer, Target
from attn_di.exceptions import (
    InvalidBackendNameError,
    InvalidBackendTypeError,
    UnexportableBackendError,
    UnknownBackendError,
)

__all__ = ["BackendContainer", "BackendKey"]

BackendKey = AttentionBackendEnum | str
"""A member, or a member's exact name."""

_C = TypeVar("_C")
_MISSING: Any = object()
_live_containers: weakref.WeakSet[_ContainerAPI] = weakref.WeakSet()
_serials = itertools.count()


class _ContainerAPI:
    """The methods of a :class:`BackendContainer` instance."""

    providers: dict[str, Any]
    wired_to_modules: list[Any]
    wired_to_packages: list[Any]
    _by_key: dict[object, BackendProvider]
    _resolved: dict[object, type[Any]]
    _warn_unresolved: bool
    _serial: int
    candidates: Any

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

    def provider(self, member: BackendKey | BackendProvider) -> BackendProvider:
        """The :class:`BackendProvider` of ``member`` in this container.

        ``member`` may also be a provider (``BackendContainer.CUSTOM``): its member is used.

        Raises:
            UnknownBackendError: no such member.
            InvalidBackendTypeError: neither a member, a name nor a provider.
        """
        try:
            return self._by_key[member]
        except (KeyError, TypeError):
            pass
        if isinstance(member, BackendProvider):
            return self.provider(member.member)
        if not isinstance(member, str):
            raise InvalidBackendTypeError(
                "member", member, "an AttentionBackendEnum member or its name"
            )
        raise UnknownBackendError(member, list(AttentionBackendEnum.__members__))

    def get_path(self, member: BackendKey, include_classname: bool = True) -> str:
        """The class path ``member`` resolves to here; see :meth:`AttentionBackendEnum.get_path`."""
        return self.provider(member).get_path(include_classname)

    def is_overridden(self, member: BackendKey) -> bool:
        """True while a registration or an override of ``member`` is active here."""
        return self.provider(member).is_overridden()

    def source(self, member: BackendKey) -> str:
        """Where ``member``'s class comes from: "local override", "override", "registered",
        "plugin" (registered by an ``attn_di.plugins`` entry point), "default", "di override"
        (dependency-injector's own), or "unset" (CUSTOM)."""
        return self.provider(member).source()

    # -- registrations ----------------------------------------------------------------
    @overload
    def register(self, member: BackendKey) -> Callable[[type[_C]], type[_C]]: ...
    @overload
    def register(self, member: BackendKey, class_path: str | type[Any]) -> Callable[[_C], _C]: ...
    def register(self, member: BackendKey, class_path: Any = None) -> Callable[[Any], Any]:
        """Register a class for ``member`` here; see :func:`register_backend`."""
        _check_key_or_new_name(member, implicit=True)
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
        new_names: dict[str, str] = {}
        for name, class_path in snapshot.items():
            if not isinstance(name, str):
                raise InvalidBackendTypeError("snapshot key", name, "a member name string")
            if not isinstance(class_path, str):
                raise InvalidBackendTypeError(f"snapshot[{name!r}]", class_path, "a class path")
            check_class_path(class_path)
            if name not in AttentionBackendEnum.__members__:
                check_new_name(name)
                if name.upper() in new_names:
                    raise InvalidBackendNameError(
                        name, f"the snapshot also adds {new_names[name.upper()]!r}"
                    )
                new_names[name.upper()] = name
        for name, class_path in snapshot.items():
            if name in AttentionBackendEnum.__members__:
                self._register(name, Target.of_path(class_path, "registered"))
            else:
                AttentionBackendEnum.register(name, class_path)

    # -- overrides --------------------------------------------------------------------
    def override(
        self, member: Any, impl: Any = _MISSING, *, local: bool = False
    ) -> BackendOverride | ContainerOverride:
        """Override backends, at once, until the returned handle is exited or restored.

        ``with container.override(AttentionBackendEnum.TRITON_ATTN, FakeBackend):`` or
        ``container.override({member: impl, ...})``. The override is a layer above the
        registrations: on exit exactly this layer is removed (also on an exception and when
        blocks exit out of order); registrations made inside the block are kept.

        Args:
            member: a member or its name, or a mapping ``{member: impl}``. A dependency-injector
                container is passed to dependency-injector's own container override (its
                handle undoes it on exit, innermost first).
            impl: a class, a dotted class path, or any callable object (e.g. a
                ``mocker.Mock(spec=...)``), returned as is by resolution.
            local: visible only in the current thread / asyncio task (a ContextVar).

        Raises:
            UnknownBackendError, InvalidBackendTypeError, InvalidClassPathError: nothing changes.
        """
        if impl is not _MISSING and not local:
            # The common case, kept short (it is timed against dependency-injector's override).
            key_ok = isinstance(member, (str, AttentionBackendEnum))
            provider = self._by_key.get(member) if key_ok else None
            if provider is not None:
                target = override_target(impl, local=False)
                handle = BackendOverride(Layer({provider: target}, False), {provider.member: impl})
                handle.apply()
                return handle
        if impl is not _MISSING:
            if isinstance(member, Mapping):
                raise InvalidBackendTypeError(
                    "impl",
                    impl,
                    "omitted when a mapping is given",
                    hint="put every impl in the mapping: container.override({member: impl})",
                )
            requested: Iterable[tuple[Any, Any]] = ((member, impl),)
        elif isinstance(member, Mapping):
            requested = member.items()
        elif containers.is_container(member):
            return ContainerOverride(self, member)
        else:
            raise InvalidBackendTypeError(
                "impl",
                None,
                "given (the class to use)",
                hint="container.override(AttentionBackendEnum.X, MyBackend)",
            )
        targets: dict[BackendProvider, Target] = {}
        impls: dict[AttentionBackendEnum, Any] = {}
        for key, value in requested:
            provider = self.provider(key)
            if provider in targets:
                raise InvalidBackendTypeError(
                    "member", key, f"given once; {provider.name} appears twice in the mapping"
                )
            targets[provider] = override_target(value, local=local)
            impls[provider.member] = value
        handle = BackendOverride(Layer(targets, local), impls)
        handle.apply()
        return handle

    def active_overrides(self) -> list[AttentionBackendEnum]:
        """Members with a global override layer or a dependency-injector override active here
        (used to catch leaks in tests)."""
        return [p.member for p in self._providers_by_name().values() if p._layers or p.overridden]

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
        self._serial = next(_serials)
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


def _default_candidates(device: Any, config: Any) -> Any:
    """attn_di's candidate policy (:func:`attn_di._selection.default_candidates`), loaded lazily."""
    from attn_di._selection import default_candidates

    return default_candidates(device, config)


def _select_from_settings(container: Any, settings: Any) -> Any:
    """The ``selection`` provider's callable (:func:`attn_di._selection.select_from_settings`)."""
    from attn_di._selection import select_from_settings

    return select_from_settings(container, settings)


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

    __self__ = providers.Self()
    attention = providers.Configuration()
    """Selection inputs: the AttentionSelectorConfig fields, plus ``device`` and ``backend``."""
    candidates = providers.Callable(_default_candidates)
    """The candidate policy ``(device, config) -> [members]``; override to inject your own."""
    selection = providers.Callable(_select_from_settings, __self__, attention)
    """The :class:`Selection` for the ``attention`` settings."""
    selected = selection.provided.backend_cls
    """The selected backend class: ``Provide[BackendContainer.selected]``."""


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


def _registration_target(class_path: object) -> Target:
    if isinstance(class_path, str):
        return Target.of_path(check_class_path(class_path), "registered")
    if isinstance(class_path, type):
        return Target.of_object(class_path, "registered")
    raise InvalidBackendTypeError("class_path", class_path, "a dotted path string or a class")


def _check_key_or_new_name(member: object, *, implicit: bool = False) -> None:
    """Accept a member, an existing name, or a valid new name (typo-guarded if ``implicit``)."""
    if isinstance(member, AttentionBackendEnum):
        return
    if not isinstance(member, str):
        raise InvalidBackendTypeError(
            "member", member, "an AttentionBackendEnum member or its name"
        )
    if member in AttentionBackendEnum.__members__:
        return
    check_new_name(member)
    if implicit:
        names = list(AttentionBackendEnum.__members__)
        import difflib  # only on error paths: keeps `import attn_di` light

        close = difflib.get_close_matches(member, names, n=1, cutoff=0.85)
        if close:
            error = UnknownBackendError(member, names)
            error.suggestion = close[0]
            error.hint = (
                f"did you mean {close[0]!r}? To add a new member with a name this close, "
                f"call AttentionBackendEnum.register({member!r}, class_path) first"
            )
            raise error


def _identity(obj: _C) -> _C:
    return obj
