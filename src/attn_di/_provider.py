"""``BackendProvider``: the lazy dependency-injector provider behind one enum member.

Resolution order, first hit wins:

1. dependency-injector's own ``provider.override(...)`` (honoured by its ``__call__``);
2. context-local override layers (this thread / asyncio task only), newest first;
3. global override layers (``with container.override(...)``), newest first;
4. the registration (``register_backend``);
5. the member's default class path.

Registrations and override layers live apart, so neither ever undoes the other, and a
layer is removed by identity: exits may come in any order. The resolved class of steps
3-5 is cached; every change bumps a version under a lock so that a resolution racing
with a change never stores a stale class. No lock is held while importing.

A path must import to a class (a backend); an object given directly (an override's test
double, a mock) is returned as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dependency_injector import providers

from attn_di._paths import import_class_path, module_part, path_of
from attn_di._state import GENERATION, LOCAL_LAYERS, REGISTRY_LOCK
from attn_di.exceptions import BackendImportError, BackendNotRegisteredError

if TYPE_CHECKING:
    from attn_di._family import BackendEnum

__all__ = ["BackendProvider", "Layer", "Target"]

_UNSET: Any = object()


class Target:
    """What a member resolves to: a dotted path, an object, or both.

    A path is imported on first :meth:`load` and the result kept.
    """

    __slots__ = ("_obj", "_path", "source")

    def __init__(self, path: str | None, obj: Any, source: str) -> None:
        self._path = path
        self._obj = obj
        self.source = source

    @classmethod
    def of_path(cls, path: str, source: str) -> Target:
        """A target for a dotted path, imported on first :meth:`load`."""
        return cls(path, _UNSET, source)

    @classmethod
    def of_object(cls, obj: Any, source: str) -> Target:
        """A target for a class (or any object, e.g. a mock) given directly."""
        return cls(None, obj, source)

    @property
    def path(self) -> str:
        """The dotted path: as given, or ``module.qualname`` of the object given."""
        path = self._path
        if path is None:
            path = self._path = path_of(self._obj)
        return path

    @property
    def has_object(self) -> bool:
        """True when the object was given directly rather than by path."""
        return self._obj is not _UNSET

    def load(self, member: str) -> Any:
        """The target object, importing its path the first time.

        Raises:
            BackendImportError: the path does not import, or names something that is not a class.
        """
        obj = self._obj
        if obj is _UNSET:
            obj = import_class_path(self.path, member)
            if not isinstance(obj, type):
                raise BackendImportError(
                    member,
                    self.path,
                    BackendImportError.NOT_A_CLASS,
                    f"it names {type(obj).__name__} {getattr(obj, '__qualname__', obj)!r}",
                )
            self._obj = obj
        return obj

    def __repr__(self) -> str:
        return f"Target({self.path!r}, source={self.source!r})"


class Layer:
    """One override block: the targets it sets, per provider.

    ``alive`` turns False when the block is restored. A context-local layer stays in the
    ContextVar of the context that made it (and of contexts copied from it) until that context
    drops it, but a dead layer is skipped everywhere: restoring from another thread works.
    ``propagate`` (global layers only) puts the layer's targets into the exported
    registrations while it is alive (``override(..., propagate=True)``).
    """

    __slots__ = ("__weakref__", "alive", "local", "propagate", "targets")

    def __init__(
        self, targets: dict[BackendProvider, Target], local: bool, propagate: bool = False
    ) -> None:
        self.targets = targets
        self.local = local
        self.propagate = propagate
        self.alive = True


class BackendProvider(providers.Provider[Any]):
    """Lazily provides the backend class of one backend enum member.

    Calling it returns the class (nothing is imported before the first call). It is what
    ``Provide[BackendContainer.TRITON_ATTN]`` injects. Use the container's methods to
    register and override; this class holds the per-container state.
    """

    def __init__(self, member: BackendEnum) -> None:
        self.member = member
        self.name = member.name
        self.enum_name = type(member).__name__
        self._default = _default_target(member)
        self._registered: Target | None = None
        self._layers: list[tuple[Layer, Target]] = []
        self._version = 0
        # The owning container's {member: class, name: class} fast-path cache (see attach),
        # and the member-keyed caches of the containers that hold the owner as a sub-container.
        self._index: dict[object, Any] = {}
        self._outer: list[dict[object, Any]] = []
        super().__init__()

    def attach(self, index: dict[object, Any]) -> None:
        """Share the owning container's fast-path cache (filled on resolve, cleared on change)."""
        with REGISTRY_LOCK:
            self._index = index
            self.invalidate()

    def attach_outer(self, index: dict[object, Any]) -> None:
        """Also fill ``index`` (an outer container's cache), keyed by member only."""
        with REGISTRY_LOCK:
            if all(outer is not index for outer in self._outer):
                self._outer.append(index)
            self.invalidate()

    # -- resolution -------------------------------------------------------------------
    def _provide(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.resolve()

    def resolve(self) -> Any:
        """The backend class, ignoring dependency-injector's own overrides (see ``__call__``).

        Raises:
            BackendNotRegisteredError: no override, registration or default path.
            BackendImportError: the path does not import.
        """
        local = LOCAL_LAYERS.get()
        if local:
            target = self._local_target(local)
            if target is not None:
                return target.load(self.name)
        cached = self._index.get(self.name)
        if cached is not None:
            return cached
        version = self._version
        resolved = self._require(self.global_target()).load(self.name)
        with REGISTRY_LOCK:
            if self._version == version and not self.overridden:
                self._index[self.member] = self._index[self.name] = resolved
                for outer in self._outer:
                    outer[self.member] = resolved
        return resolved

    def effective_target(self) -> Target | None:
        """The target a call in this context would use (dependency-injector overrides aside)."""
        local = LOCAL_LAYERS.get()
        if local:
            target = self._local_target(local)
            if target is not None:
                return target
        return self.global_target()

    @property
    def registered_target(self) -> Target | None:
        """The registration's target (what ``register_backend`` set), or None."""
        return self._registered

    def global_target(self) -> Target | None:
        """The newest global layer's target, else the registration, else the default."""
        layers = self._layers
        if layers:
            return layers[-1][1]
        return self._registered or self._default

    def propagated_target(self) -> Target | None:
        """The newest global layer's target entered with ``propagate=True``, or None: what
        the exported registrations carry for this member in its place (see
        ``export_registrations``)."""
        for layer, target in reversed(self._layers):
            if layer.propagate and layer.alive:
                return target
        return None

    def get_path(self, include_classname: bool = True) -> str:
        """The class path of the effective target (module part only if not include_classname).

        Raises:
            BackendNotRegisteredError: nothing to resolve to.
        """
        if self.overridden:  # dependency-injector's own override: describe what it provides
            provided = self()
            if include_classname:
                return path_of(provided)
            return str(getattr(provided, "__module__", type(provided).__module__))
        target = self._require(self.effective_target())
        if include_classname:
            return target.path
        if target.has_object:
            return str(getattr(target.load(self.name), "__module__", module_part(target.path)))
        return module_part(target.path)

    def is_overridden(self) -> bool:
        """True while a registration, a global or local layer, or a DI override is active."""
        if self._registered is not None or self._layers or self.overridden:
            return True
        local = LOCAL_LAYERS.get()
        return bool(local) and self._local_target(local) is not None

    def source(self) -> str:
        """Where the effective target comes from: "local override", "override",
        "registered", "default", "di override" or "unset"."""
        if self.overridden:
            return "di override"
        target = self.effective_target()
        return "unset" if target is None else target.source

    # -- state changes (called by the container, under REGISTRY_LOCK) -------------------
    def set_registration(self, target: Target | None) -> None:
        """Replace the registration (None clears it)."""
        self._registered = target
        self.invalidate()

    def push_layer(self, layer: Layer, target: Target) -> None:
        """Add a global override layer on top."""
        self._layers.append((layer, target))
        self.invalidate()

    def remove_layer(self, layer: Layer) -> None:
        """Remove exactly this layer's entry, wherever it is in the stack."""
        layers = self._layers
        if layers and layers[-1][0] is layer:  # the usual, nested case
            layers.pop()
        else:
            self._layers = [entry for entry in layers if entry[0] is not layer]
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the cached class; bump the version so in-flight resolutions do not store."""
        self._version += 1
        GENERATION[0] += 1
        index = self._index
        index.pop(self.member, None)
        index.pop(self.name, None)
        for outer in self._outer:
            outer.pop(self.member, None)

    # -- dependency-injector hooks ---------------------------------------------------
    def override(self, provider: Any) -> Any:
        """dependency-injector's override (a stack above everything attn_di manages)."""
        with REGISTRY_LOCK:
            self.invalidate()
            return super().override(provider)

    def reset_last_overriding(self) -> None:
        with REGISTRY_LOCK:
            self.invalidate()
            super().reset_last_overriding()

    def reset_override(self) -> None:
        with REGISTRY_LOCK:
            self.invalidate()
            super().reset_override()

    def __deepcopy__(self, memo: dict[int, Any] | None) -> BackendProvider:
        memo = {} if memo is None else memo
        copied = memo.get(id(self))
        if copied is not None:
            return copied  # type: ignore[no-any-return]
        copied = type(self)(self.member)
        copied._registered = self._registered
        memo[id(self)] = copied
        self._copy_overridings(copied, memo)
        return copied

    def __repr__(self) -> str:
        target = self.effective_target()
        where = "unset" if target is None else f"{target.path} ({target.source})"
        return f"<BackendProvider {self.name} -> {where}>"

    __str__ = __repr__

    # -- helpers ----------------------------------------------------------------------
    def _local_target(self, local: tuple[Layer, ...]) -> Target | None:
        for layer in reversed(local):
            target = layer.targets.get(self)
            if target is not None and layer.alive:
                return target
        return None

    def _require(self, target: Target | None) -> Target:
        if target is None:
            raise BackendNotRegisteredError(self.name, self.enum_name)
        return target


def _default_target(member: BackendEnum) -> Target | None:
    default_cls = getattr(member, "_default_cls_", _UNSET)
    if default_cls is not _UNSET:
        return Target(member.default_path, default_cls, "default")
    path = member.default_path
    return None if path is None else Target.of_path(path, "default")
