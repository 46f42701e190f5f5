"""Containers: one lazy :class:`BackendProvider` per member of a backend enum.

``BackendContainer`` holds the attention members, a ``mamba`` sub-container
(``MambaBackendContainer``, the Mamba members: ``container.mamba.MAMBA2``,
``Provide[BackendContainer.mamba.MAMBA2]``), and the selection providers (``attention``,
``candidates``, ``selection``, ``selected``). Every method takes members of either enum:
``container.backend(MambaAttentionBackendEnum.MAMBA2)`` resolves through the sub-container.
Names given as strings are the attention enum's (``container.mamba.backend("MAMBA2")`` for
Mamba names). The process-wide default container lives in :mod:`attn_di._default`.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast, overload

from dependency_injector import containers, providers

from attn_di._enum import ATTENTION, MAMBA, AttentionBackendEnum, MambaAttentionBackendEnum
from attn_di._family import (
    BackendEnum,
    BackendFamily,
    family_of,
    is_alias_member,
    native_member,
    on_member_added,
    on_member_removed,
)
from attn_di._overrides import (
    BackendOverride,
    ContainerOverride,
    check_propagation,
    override_target,
)
from attn_di._paths import check_class_path, resolves_to
from attn_di._provider import BackendProvider, Layer, Target
from attn_di._state import (
    LOCAL_LAYERS,
    REGISTRY_LOCK,
    notify_quietly,
    notify_registrations_changed,
    snapshot,
    user_stacklevel,
)
from attn_di.exceptions import (
    InvalidBackendNameError,
    InvalidBackendTypeError,
    UnexportableBackendError,
    UnexportableBackendWarning,
    UnknownBackendError,
)

__all__ = [
    "SELECTION_HOOKS",
    "BackendContainer",
    "BackendKey",
    "MambaBackendContainer",
    "RuntimeProviders",
    "warn_unexportable",
]

BackendKey = BackendEnum | str
"""A member (of either enum), or an attention member's name (any case; ``-`` or a space for
``_``; the exact name wins)."""

SELECTION_HOOKS: dict[str, Callable[..., Any]] = {}
"""``"candidates"`` and ``"select"``: installed by :mod:`attn_di._default` (they load
:mod:`attn_di._selection`, a higher layer, on first use)."""

_C = TypeVar("_C")
_local_layers = LOCAL_LAYERS.get  # bound once: the warm path of backend() calls it
_MISSING: Any = object()
_live_containers: weakref.WeakSet[_ContainerAPI] = weakref.WeakSet()
_serials = itertools.count()
_warned_unexportable: set[tuple[str, str]] = set()


class _ContainerAPI:
    """The methods of a container instance (``BackendContainer()``, ``container.mamba``)."""

    family: ClassVar[BackendFamily]
    _display_name: ClassVar[str]
    providers: dict[str, Any]
    wired_to_modules: list[Any]
    wired_to_packages: list[Any]
    _by_key: dict[object, BackendProvider]
    _resolved: dict[object, type[Any]]
    _subs: dict[BackendFamily, _ContainerAPI]
    _outer: list[_ContainerAPI]
    _warn_unresolved: bool
    _serial: int
    candidates: Any

    # -- resolving --------------------------------------------------------------------
    def backend(self, member: BackendKey) -> type[Any]:
        """The backend class for ``member`` (a member or its name), imported on first use.

        Names follow the name rule (``"CPU_ATTN"``, ``"cpu_attn"``, ``"cpu-attn"``; the exact
        name wins); the warm path (a member, or an exact name, already resolved) is one dict
        lookup.

        Raises:
            UnknownBackendError: no such member (lists the valid names, suggests one).
            BackendNotRegisteredError: the member has no path (CUSTOM before registration).
            BackendImportError: its path does not import, or names something not a class.
        """
        if not _local_layers():
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

        ``member`` may be a member of either enum, a name of this container's enum (as typed:
        ``"cpu_attn"``, ``"torch sdpa"``; the exact name wins, see
        :meth:`~attn_di._family.BackendFamily.find`), or a provider
        (``BackendContainer.CUSTOM``): its member is used.

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
        native = native_member(member)  # another project's member (register_enum_alias)
        if native is not member:
            return self.provider(native)
        if isinstance(member, BackendEnum):
            family = family_of(member)
            sub = self._subs.get(family)
            if sub is not None:
                return sub.provider(member)
            if family is self.family:  # a member removed by hand, as vLLM's tests do
                raise self.family.unknown(member.name)
            raise InvalidBackendTypeError(
                "member", member, f"a member of {self.family.enum.__name__}"
            )
        if not isinstance(member, str):
            raise InvalidBackendTypeError(
                "member", member, f"an {self.family.enum.__name__} member or its name"
            )
        found = self.family.find(member)  # the name rule, only on a miss of the exact name
        if found is not None:
            return self.provider(found)
        error = self.family.unknown(member)
        for family in self._subs:
            try:
                other = family.find(member)
            except UnknownBackendError:  # several Mamba members differ only by case
                other = None
            if other is not None:
                error.hint = (
                    f"{other.name} is a {family.enum.__name__} member: pass "
                    f"{family.enum.__name__}.{other.name}, or use container.{family.key}"
                )
        raise error

    def get_path(self, member: BackendKey, include_classname: bool = True) -> str:
        """The class path ``member`` resolves to here; see :meth:`BackendEnum.get_path`."""
        return self.provider(member).get_path(include_classname)

    def is_overridden(self, member: BackendKey) -> bool:
        """True while a registration or an override of ``member`` is active here."""
        return self.provider(member).is_overridden()

    def registration(self, member: BackendKey) -> str | None:
        """The dotted path registered for ``member`` here, or None.

        Only the registration (``register_backend``, an ``attn_di.plugins`` entry point,
        ``ATTN_DI_REGISTRATIONS``); override blocks are not registrations. A class registered
        directly gives its ``module.qualname``. A runtime member created by a registration
        has one until ``clear_override()``.

        Raises:
            UnknownBackendError: no such member.
        """
        target = self.provider(member).registered_target
        return None if target is None else target.path

    def source(self, member: BackendKey) -> str:
        """Where ``member``'s class comes from: "local override", "override", "registered",
        "plugin" (registered by an ``attn_di.plugins`` entry point), "default", "di override"
        (dependency-injector's own), or "unset" (CUSTOM)."""
        return self.provider(member).source()

    # -- registrations ----------------------------------------------------------------
    @overload
    def register(
        self, member: BackendKey | BackendProvider, *, is_mamba: bool = False
    ) -> Callable[[type[_C]], type[_C]]: ...
    @overload
    def register(
        self,
        member: BackendKey | BackendProvider,
        class_path: str | type[Any],
        *,
        is_mamba: bool = False,
    ) -> Callable[[_C], _C]: ...
    def register(
        self, member: Any, class_path: Any = None, *, is_mamba: bool = False
    ) -> Callable[[Any], Any]:
        """Register a class for ``member`` here; see :func:`attn_di.register_backend`."""
        if isinstance(member, BackendProvider):
            member = member.member
        member = native_member(member)
        home = self._home(member, is_mamba)
        if home is not self:
            return home.register(member, class_path)
        if isinstance(member, str):
            self.family.check_name_form(member)  # it may exist by the time it is created
        elif not isinstance(member, BackendEnum):
            raise InvalidBackendTypeError(
                "backend", member, "a backend enum member, its name, or a new member's name"
            )
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

    def clear_override(self, member: BackendKey | BackendProvider) -> None:
        """Forget ``member``'s registration here (no-op if none); override blocks are untouched.

        A runtime member returns to its value (the path it was created with)."""
        provider = self.provider(member)
        with REGISTRY_LOCK:
            previous = provider._registered
            provider.set_registration(None)
        if previous is None:
            return
        try:
            notify_registrations_changed(self._top())
        except BaseException:
            with REGISTRY_LOCK:
                if provider._registered is None:
                    provider.set_registration(previous)
            notify_quietly(self._top())
            raise

    def export_registrations(self, strict: bool = True) -> dict[str, str]:
        """A JSON-serialisable snapshot ``{name: dotted path}`` of the registrations.

        Runtime members are included (with their registered or default path), so that
        :meth:`apply_registrations` can recreate them in another process, except a member
        created for another project's member (:func:`attn_di.register_enum_alias`) while it
        has no registration: its default is that project's, not a registration. A
        sub-container's names carry its key (``"mamba:CUSTOM"``). Override blocks are
        scoped, never exported, except those entered with ``propagate=True``: while one is
        active, its class is exported for the member in place of the registration.

        Args:
            strict: raise for a class with no importable path; False leaves it out with an
                :class:`~attn_di.exceptions.UnexportableBackendWarning` naming it (once).

        Raises:
            UnexportableBackendError: (strict) a registered class whose ``module.qualname`` does
                not import back to it (e.g. defined inside a function).
        """
        snapshot, skipped = self._export(strict)
        warn_unexportable(skipped)
        return snapshot

    def _export(self, strict: bool) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
        """:meth:`export_registrations` without its warnings: ``(snapshot, skipped)``,
        ``skipped`` the ``(name, path, reason)`` left out (not strict) for
        :func:`warn_unexportable`, which the caller calls once its state is consistent."""
        snapshot: dict[str, str] = {}
        skipped: list[tuple[str, str, str]] = []
        for prefix, container in self._families():
            builtin = container.family.builtin
            for provider in container._own_providers():
                name = provider.name
                target = provider.propagated_target() or provider._registered
                if target is None and (name in builtin or is_alias_member(provider.member)):
                    continue  # a default: built in, or another project's (an enum alias)
                target = target or provider._default
                if target is None:
                    continue
                if target.has_object and not _exportable(target, name, strict):
                    reason = "does not import back to the same class in a new process"
                    if strict:
                        raise UnexportableBackendError(name, target.path, reason)
                    skipped.append((name, target.path, reason))
                    continue
                snapshot[prefix + name] = target.path
        return snapshot, skipped

    def apply_registrations(self, snapshot: Mapping[str, str]) -> None:
        """Apply a snapshot made by :meth:`export_registrations` (e.g. in a worker process).

        Unknown names become runtime members. Everything is validated first: on error nothing
        changes.

        Raises:
            InvalidBackendTypeError: not a mapping of strings to strings.
            InvalidBackendNameError: a new name that is refused, or an unknown family key.
            InvalidClassPathError: a malformed path.
        """
        if not isinstance(snapshot, Mapping):
            raise InvalidBackendTypeError("snapshot", snapshot, "a mapping {name: class path}")
        by_prefix = {prefix: container for prefix, container in self._families()}
        plan: list[tuple[_ContainerAPI, str, str]] = []
        new_names: set[tuple[str, str]] = set()
        for key, class_path in snapshot.items():
            if not isinstance(key, str):
                raise InvalidBackendTypeError("snapshot key", key, "a member name string")
            if not isinstance(class_path, str):
                raise InvalidBackendTypeError(f"snapshot[{key!r}]", class_path, "a class path")
            check_class_path(class_path)
            prefix, colon, name = key.rpartition(":")
            container = by_prefix.get(f"{prefix}:" if colon else "")
            if container is None:
                raise InvalidBackendNameError(
                    key, f"unknown family {prefix!r}; known: {sorted(by_prefix)}"
                )
            if name not in container.family.enum._member_map_:
                container.family.check_name_form(name)
                if (prefix, name) in new_names:
                    raise InvalidBackendNameError(key, "the snapshot adds it twice")
                new_names.add((prefix, name))
            plan.append((container, name, class_path))
        undo: list[tuple[BackendProvider, Target | None]] = []
        created: list[tuple[_ContainerAPI, Any]] = []
        try:
            with REGISTRY_LOCK:  # all at once: no thread sees half a snapshot
                for container, name, class_path in plan:
                    member, new = container.family.ensure_member(name, class_path)
                    if new:
                        created.append((container, member))
                        continue
                    provider = container.provider(member)
                    undo.append((provider, provider._registered))
                    provider.set_registration(Target.of_path(class_path, "registered"))
            notify_registrations_changed(None)
        except BaseException:  # a warning turned into an error, or a listener failed
            with REGISTRY_LOCK:
                for provider, previous in reversed(undo):
                    provider.set_registration(previous)
                for container, member in reversed(created):
                    container.family.remove_member(member, notify=False)
            notify_quietly(None)
            raise

    # -- overrides --------------------------------------------------------------------
    def override(
        self, member: Any, impl: Any = _MISSING, *, local: bool = False, propagate: bool = False
    ) -> BackendOverride | ContainerOverride:
        """Override backends, at once, until the returned handle is exited or restored.

        ``with container.override(AttentionBackendEnum.TRITON_ATTN, FakeBackend):`` or
        ``container.override({member: impl, ...})``; members of either enum. The override is a
        layer above the registrations: on exit exactly this layer is removed (also on an
        exception and when blocks exit out of order); registrations made inside are kept.

        Args:
            member: a member or its name, or a mapping ``{member: impl}``. A dependency-injector
                container is passed to dependency-injector's own container override (its
                handle undoes it on exit, innermost first).
            impl: a class, a dotted class path, or any callable object (e.g. a
                ``mocker.Mock(spec=...)``), returned as is by resolution.
            local: visible only in the current thread / asyncio task (a ContextVar) and in
                tasks it starts.
            propagate: also reach the processes started while the block is active (vLLM's
                workers and engine cores, multiprocessing spawn children, subprocesses): the
                override goes into ``ATTN_DI_REGISTRATIONS`` (as a registration would) until
                the block ends. Only for classes another process can import by their path
                (or dotted paths), in the default container with automatic propagation on.

        Raises:
            UnknownBackendError, InvalidBackendTypeError, InvalidClassPathError: nothing changes.
            UnexportableBackendError: (``propagate=True``) a class with no importable path, a
                test double, or a container whose changes are not propagated now (the reason
                says which); nothing changes.
        """
        if not isinstance(propagate, bool):
            raise InvalidBackendTypeError("propagate", propagate, "True or False")
        if impl is not _MISSING and not local and not propagate:
            # The common case, kept short (it is timed against dependency-injector's override).
            key_ok = isinstance(member, (str, BackendEnum))
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
            if propagate:
                raise InvalidBackendTypeError(
                    "propagate",
                    True,
                    "False for a dependency-injector container override",
                    hint="override members (container.override(member, impl, propagate=True))",
                )
            return ContainerOverride(self, member)
        else:
            raise InvalidBackendTypeError(
                "impl",
                None,
                "given (the class to use)",
                hint="container.override(AttentionBackendEnum.X, MyBackend)",
            )
        targets: dict[BackendProvider, Target] = {}
        impls: dict[BackendEnum, Any] = {}
        for key, value in requested:
            provider = self.provider(key)
            if provider in targets:
                raise InvalidBackendTypeError(
                    "member", key, f"given once; {provider.name} appears twice in the mapping"
                )
            target = override_target(value, local=local)
            if propagate:
                check_propagation(self._top(), provider.name, target, local=local)
            targets[provider] = target
            impls[provider.member] = value
        handle = BackendOverride(Layer(targets, local, propagate), impls)
        handle.apply()
        return handle

    def active_overrides(self) -> list[BackendEnum]:
        """Members with a global override layer or a dependency-injector override active here
        or in a sub-container (used to catch leaks in tests)."""
        return [p.member for p in self.all_providers() if p._layers or p.overridden]

    def all_providers(self) -> list[BackendProvider]:
        """Every provider here and in the sub-containers, the primary family first."""
        return [p for _, container in self._families() for p in container._own_providers()]

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
    def _home(self, member: object, is_mamba: bool) -> _ContainerAPI:
        """The container (this one or a sub-container) whose enum ``member`` belongs to."""
        if isinstance(member, BackendEnum):
            family = family_of(member)
        elif isinstance(member, str) and is_mamba:
            family = MAMBA
        else:
            return self
        if family is self.family:
            return self
        sub = self._subs.get(family)
        if sub is None:
            raise InvalidBackendTypeError(
                "backend", member, f"a member of {self.family.enum.__name__} in this container"
            )
        return sub

    def _register(self, member: BackendKey, target: Target) -> None:
        """Record ``target`` as ``member``'s registration, creating a runtime member for a new
        name (vLLM >= 0.32: the member is valued by the path and the registration recorded,
        so is_overridden() is True and clear_override() returns to the value).

        Creating the member and registering are one step under the registry lock: threads
        registering one new name at once all succeed, and the last registration wins. If
        telling the listeners fails (a warning turned into an error, ``-W error``), the
        change is undone before the error propagates.
        """
        with REGISTRY_LOCK:
            created = False
            if isinstance(member, str) and member not in self.family.enum._member_map_:
                default_cls = target.load(member) if target.has_object else None
                member, created = self.family.ensure_member(member, target.path, default_cls)
            provider = self.provider(member)
            previous = provider._registered
            provider.set_registration(target)
        try:
            notify_registrations_changed(None if created else self._top())
        except BaseException:
            with REGISTRY_LOCK:
                if provider._registered is target:
                    provider.set_registration(previous)
            if created:
                self.family.remove_member(provider.member, notify=False)
            notify_quietly(None if created else self._top())
            raise

    def _own_providers(self) -> list[BackendProvider]:
        """This container's providers, one per live member of its enum, in enum order."""
        by_key = snapshot(lambda: dict(self._by_key))
        found = [by_key.get(member) for member in self.family.members()]
        return [p for p in found if p is not None]

    def _families(self) -> list[tuple[str, _ContainerAPI]]:
        return [("", self), *((f"{f.key}:", sub) for f, sub in self._subs.items())]

    def _top(self) -> _ContainerAPI:
        return self._outer[0]._top() if self._outer else self

    def _providers_by_name(self) -> dict[str, BackendProvider]:
        return {p.name: p for p in self._own_providers()}

    def __repr__(self) -> str:
        by_name = self._providers_by_name()
        registered = [n for n, p in by_name.items() if p._registered is not None]
        overridden = [n for n, p in by_name.items() if p._layers]
        return (
            f"<{self._display_name} members={len(by_name)} registered={registered} "
            f"overridden={overridden}"
            + "".join(f" {family.key}={sub!r}" for family, sub in self._subs.items())
            + ">"
        )


class _ContainerInstance(_ContainerAPI, containers.DynamicContainer):  # type: ignore[misc]
    """The type of container instances (dependency-injector makes a copy of the class)."""

    def __init__(self) -> None:
        self._serial = next(_serials)
        self._by_key = {}
        self._resolved = {}
        self._subs = {}
        self._outer = []
        self._warn_unresolved = False
        super().__init__()
        _live_containers.add(self)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if isinstance(value, BackendProvider):
            self._by_key[value.member] = value
            self._by_key[value.name] = value
            value.attach(self._resolved)
            for outer in self._outer:
                value.attach_outer(outer._resolved)
        elif isinstance(value, providers.Container):
            sub = value.container
            if isinstance(sub, _ContainerAPI) and sub.family is not self.family:
                self._subs[sub.family] = sub
                sub._outer.append(self)
                for provider in sub._own_providers():
                    provider.attach_outer(self._resolved)


class _AttentionContainerInstance(_ContainerInstance):
    family = ATTENTION
    _display_name = "BackendContainer"


class _MambaContainerInstance(_ContainerInstance):
    family = MAMBA
    _display_name = "MambaBackendContainer"


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
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # dependency-injector copies the class's providers: not while a runtime member is
        # being added to them by another thread.
        with REGISTRY_LOCK:
            return super().__call__(*args, **kwargs)

    def __instancecheck__(self, instance: object) -> bool:
        # ``BackendContainer()`` returns a copy of another type: make isinstance() say yes.
        expected = _INSTANCE_TYPES.get(self)
        if expected is not None and isinstance(instance, expected):
            return True
        return super().__instancecheck__(instance)


class MambaBackendContainer(_DeclarativeBase, metaclass=_BackendContainerMeta):
    """One lazy :class:`BackendProvider` per :class:`MambaAttentionBackendEnum` member.

    Usually reached as ``container.mamba`` of a :class:`BackendContainer`; string names
    given to its methods are Mamba names.
    """

    instance_type = _MambaContainerInstance

    MAMBA1 = BackendProvider(MambaAttentionBackendEnum.MAMBA1)
    MAMBA2 = BackendProvider(MambaAttentionBackendEnum.MAMBA2)
    SHORT_CONV = BackendProvider(MambaAttentionBackendEnum.SHORT_CONV)
    LINEAR = BackendProvider(MambaAttentionBackendEnum.LINEAR)
    GDN_ATTN = BackendProvider(MambaAttentionBackendEnum.GDN_ATTN)
    CUSTOM = BackendProvider(MambaAttentionBackendEnum.CUSTOM)


def _candidates_hook(device: Any, config: Any) -> Any:
    """attn_di's candidate policy (:func:`attn_di._selection.default_candidates`)."""
    return SELECTION_HOOKS["candidates"](device, config)


def _select_hook(container: Any, settings: Any) -> Any:
    """The ``selection`` provider's callable (:func:`attn_di._selection.select_from_settings`)."""
    return SELECTION_HOOKS["select"](container, settings)


class BackendContainer(_DeclarativeBase, metaclass=_BackendContainerMeta):
    """One lazy :class:`BackendProvider` per :class:`AttentionBackendEnum` member, and the
    Mamba members in ``mamba`` (a :class:`MambaBackendContainer`).

    ``Provide[BackendContainer.TRITON_ATTN]`` (or ``Provide[BackendContainer.mamba.MAMBA2]``)
    injects the member's class; nothing is imported until a provider is called. Runtime
    members get a provider here and in every live instance. Each instance has its own
    registrations and overrides.

    Example::

        container = BackendContainer()
        backend_cls = container.backend(AttentionBackendEnum.CPU_ATTN)
        with container.override(AttentionBackendEnum.CPU_ATTN, MyBackend):
            assert container.backend("CPU_ATTN") is MyBackend
    """

    instance_type = _AttentionContainerInstance

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

    mamba = providers.Container(MambaBackendContainer)
    """The Mamba members' providers: ``Provide[BackendContainer.mamba.MAMBA2]``."""

    __self__ = providers.Self()
    attention = providers.Configuration()
    """Selection inputs: the AttentionSelectorConfig fields, plus ``device`` and ``backend``."""
    candidates = providers.Callable(_candidates_hook)
    """The candidate policy ``(device, config) -> [members]``; override to inject your own."""
    selection = providers.Callable(_select_hook, __self__, attention)
    """The :class:`Selection` for the ``attention`` settings."""
    selected = selection.provided.backend_cls
    """The selected backend class: ``Provide[BackendContainer.selected]``."""


_INSTANCE_TYPES: dict[type[Any], type[_ContainerInstance]] = {
    BackendContainer: _AttentionContainerInstance,
    MambaBackendContainer: _MambaContainerInstance,
}
_DECLARATIVE: dict[BackendFamily, type[Any]] = {
    ATTENTION: BackendContainer,
    MAMBA: MambaBackendContainer,
}
for _family in _DECLARATIVE:
    for _cls in (*_DECLARATIVE.values(), *_INSTANCE_TYPES.values()):
        _family.reserved.update(name for name in dir(_cls) if not name.isupper())
    _family.reserved.update({"mamba", "attention", "candidates", "selection", "selected"})
del _family, _cls


def _add_runtime_provider(member: Any) -> None:
    family = family_of(member)
    setattr(_DECLARATIVE[family], member.name, BackendProvider(member))
    for container in snapshot(lambda: list(_live_containers)):
        if container.family is family:
            setattr(container, member.name, BackendProvider(member))


def _remove_runtime_provider(member: Any) -> None:
    family = family_of(member)
    declarative = _DECLARATIVE[family]
    provider = vars(declarative).get(member.name)
    if isinstance(provider, BackendProvider) and provider.member is member:
        delattr(declarative, member.name)
    for container in snapshot(lambda: list(_live_containers)):
        if container.family is not family:
            continue
        removed = container._by_key.pop(member, None)
        if removed is not None and container._by_key.get(member.name) is removed:
            del container._by_key[member.name]
            with REGISTRY_LOCK:
                removed.invalidate()
            delattr(container, member.name)


on_member_added(_add_runtime_provider)
on_member_removed(_remove_runtime_provider)


class RuntimeProviders:
    """The providers of every runtime member, as they are when made: in the declarative
    container classes and in every live container. :meth:`restore` gives members removed and
    put back since (:meth:`~attn_di._family.BackendFamily.restore_members`) those very
    providers again, with their registrations, override layers and dependency-injector
    overrides (a failed plugin's rollback)."""

    def __init__(self) -> None:
        self.held: dict[BackendEnum, list[tuple[Any, BackendProvider]]] = {}
        with REGISTRY_LOCK:
            for family, declarative in _DECLARATIVE.items():
                for member in family.runtime_members():
                    provider = vars(declarative).get(member.name)
                    if isinstance(provider, BackendProvider) and provider.member is member:
                        self.held.setdefault(member, []).append((declarative, provider))
            for container in snapshot(lambda: list(_live_containers)):
                for member in container.family.runtime_members():
                    provider = container._by_key.get(member)
                    if provider is not None:
                        self.held.setdefault(member, []).append((container, provider))

    def restore(self, members: Iterable[BackendEnum]) -> None:
        """Put back the providers ``members`` had when this was made, in place of those made
        for them since."""
        with REGISTRY_LOCK:
            for member in members:
                for holder, provider in self.held.get(member, ()):
                    setattr(holder, member.name, provider)


def _registration_target(class_path: object) -> Target:
    if isinstance(class_path, str):
        return Target.of_path(check_class_path(class_path), "registered")
    if isinstance(class_path, type):
        return Target.of_object(class_path, "registered")
    raise InvalidBackendTypeError("class_path", class_path, "a dotted path string or a class")


def _exportable(target: Target, name: str, strict: bool) -> bool:
    """Whether another process can import the target's class by its path.

    Strict: the path must import back to the class now. Otherwise only a path that can never
    import (``<locals>``) counts: a class being decorated at module level is not bound to its
    name yet when its registration is propagated.
    """
    if strict:
        return resolves_to(target.path, target.load(name))
    return "<" not in target.path


def warn_unexportable(skipped: Iterable[tuple[str, str, str]]) -> None:
    """Warn once per ``(name, path)`` of ``skipped`` (from ``_export``) that it is not
    propagated. A warning an error filter raises is raised again next time."""
    for name, class_path, reason in skipped:
        if (name, class_path) in _warned_unexportable:
            continue
        warnings.warn(
            f"the registration of {name} ({class_path}) is not propagated to worker processes: "
            f"the class {reason}; define it at module level or register it by dotted path",
            UnexportableBackendWarning,
            stacklevel=user_stacklevel(),
        )
        _warned_unexportable.add((name, class_path))


def _identity(obj: _C) -> _C:
    return obj
