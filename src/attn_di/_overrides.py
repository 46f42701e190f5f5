"""Override layers: the handle returned by ``container.override(...)``."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dependency_injector import containers

from attn_di._paths import check_class_path, resolves_to
from attn_di._provider import Layer, Target
from attn_di._state import (
    GENERATION,
    LOCAL_LAYERS,
    PROPAGATION,
    REGISTRY_LOCK,
    notify_quietly,
    notify_registrations_changed,
)
from attn_di.exceptions import InvalidBackendTypeError, UnexportableBackendError

if TYPE_CHECKING:
    from typing import Self

    from attn_di._family import BackendEnum

__all__ = ["BackendOverride", "ContainerOverride", "check_propagation", "override_target"]


class BackendOverride:
    """One override layer, active from creation until :meth:`restore` (or the ``with`` exit).

    Exiting removes exactly this layer: other layers, entered before or after and exited in
    any order, stay; registrations made meanwhile are kept. Restoring twice is a no-op.
    A local layer is visible only in the context (thread / asyncio task) that made it and in
    contexts copied from it; restoring it from any thread ends it in all of them.

    A layer entered with ``propagate=True`` is also in the exported registrations
    (``ATTN_DI_REGISTRATIONS``) while it is active, so processes started meanwhile resolve its
    classes too; exiting rewrites the variable without it.

    Attributes:
        impls: ``{member: impl}`` as given.
        local: whether the layer is context-local.
        propagate: whether the layer reaches processes started while it is active.
    """

    def __init__(self, layer: Layer, impls: Mapping[BackendEnum, Any]) -> None:
        self._layer = layer
        self.impls = impls
        self.local = layer.local
        self.propagate = layer.propagate
        self._active = False

    @property
    def active(self) -> bool:
        """True until restored (or rolled back with a failed plugin that made it)."""
        return self._active and self._layer.alive

    def apply(self) -> None:
        """Put the layer in place (done by ``container.override``)."""
        if self._layer.local:
            LOCAL_LAYERS.set((*_alive(LOCAL_LAYERS.get()), self._layer))
        else:
            with REGISTRY_LOCK:
                for provider, target in self._layer.targets.items():
                    provider.push_layer(self._layer, target)
        self._active = bool(self._layer.targets)
        if self._layer.propagate:
            try:
                notify_registrations_changed(None)  # write ATTN_DI_REGISTRATIONS with it
            except BaseException:  # a warning turned into an error: as before the call
                self._remove()
                notify_quietly(None)
                raise

    def restore(self) -> None:
        """Remove this layer (and nothing else). No-op if already removed."""
        if not self._active:
            return
        self._active = False
        layer = self._layer
        if layer.local:
            with REGISTRY_LOCK:
                layer.alive = False  # skipped in every context that still holds it
                GENERATION[0] += 1
            LOCAL_LAYERS.set(_alive(LOCAL_LAYERS.get()))
            return
        self._remove()
        if layer.propagate:
            notify_registrations_changed(None)  # ATTN_DI_REGISTRATIONS without it

    def _remove(self) -> None:
        self._active = False
        self._layer.alive = False
        with REGISTRY_LOCK:
            for provider in self._layer.targets:
                provider.remove_layer(self._layer)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        names = ", ".join(f"{member.name}={_describe(impl)}" for member, impl in self.impls.items())
        state = "active" if self._active else "restored"
        kind = "local " if self.local else "propagated " if self.propagate else ""
        return f"<BackendOverride {kind}{state}: {names}>"


class ContainerOverride:
    """dependency-injector's container override (``container.override(other_container)``),
    applied at once; :meth:`restore` (or the ``with`` exit) undoes it.

    Exactly the providers it overrode are restored: dependency-injector's own
    ``reset_last_overriding()`` walks every provider of the container, and raised on the first
    one the override had not touched (the ``__self__`` provider ``wire()`` adds, or any
    provider the other container lacks). dependency-injector keeps container overrides on
    one stack and can only pop its top, so these must be restored innermost first; restoring
    another one first raises.
    """

    def __init__(self, container: Any, overriding: Any) -> None:
        self._container = container
        self.overriding = overriding
        self._touched = _override_container(container, overriding)
        self._active = True

    @property
    def active(self) -> bool:
        """True until restored."""
        return self._active

    def restore(self) -> None:
        """Undo the container override. No-op if already restored.

        Raises:
            InvalidBackendTypeError: another container override was applied later and is still
                active, or a provider was overridden again inside the block and that override
                is still in place (dependency-injector cannot remove one from the middle of a
                stack). Nothing changes then.
        """
        if not self._active:
            return
        stack = self._container.overridden
        buried = [
            provider
            for provider, ours in self._touched
            if provider.overridden and provider.overridden[-1] is not ours
            and any(entry is ours for entry in provider.overridden)
        ]  # fmt: skip
        if not stack or stack[-1] is not self.overriding or buried:
            raise InvalidBackendTypeError(
                "restore order",
                self.overriding,
                "the innermost container override",
                hint="restore dependency-injector container overrides innermost first, and "
                "provider overrides made inside the block before it ends",
            )
        for provider, ours in reversed(self._touched):
            if provider.overridden and provider.overridden[-1] is ours:
                provider.reset_last_overriding()
        self._container.overridden = stack[:-1]
        self._active = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.restore()
            return
        try:
            self.restore()
        except Exception as error:  # never replace the body's exception
            exc.add_note(f"attn_di: the container override was not restored: {error}")


def _override_container(container: Any, overriding: Any) -> list[tuple[Any, Any]]:
    """dependency-injector's ``container.override(overriding)``; returns ``[(provider, the
    provider overriding it)]`` for each provider it overrode. If it raises midway, what it
    did is undone first (nothing changes)."""
    before = {name: len(provider.overridden) for name, provider in container.providers.items()}
    try:
        containers.DynamicContainer.override(container, overriding)
    except BaseException:
        _undo(container, before)
        if container.overridden and container.overridden[-1] is overriding:
            container.overridden = container.overridden[:-1]
        raise
    touched = []
    for name, provider in container.providers.items():
        if len(provider.overridden) > before.get(name, 0):
            touched.append((provider, provider.overridden[-1]))
    return touched


def _undo(container: Any, before: Mapping[str, int]) -> None:
    """Pop the overrides pushed on ``container``'s providers since ``before`` (their depths)."""
    for name, provider in reversed(list(container.providers.items())):
        while len(provider.overridden) > before.get(name, 0):
            provider.reset_last_overriding()


def override_target(impl: object, *, local: bool) -> Target:
    """The :class:`Target` of an override.

    Raises:
        InvalidClassPathError: a malformed path string.
        InvalidBackendTypeError: None or a non-callable object.
    """
    source = "local override" if local else "override"
    if isinstance(impl, str):
        return Target.of_path(check_class_path(impl), source)
    if impl is None or not callable(impl):
        raise InvalidBackendTypeError(
            "impl", impl, "a backend class, a dotted class path, or a callable test double"
        )
    return Target.of_object(impl, source)


def check_propagation(container: object, member: str, target: Target, *, local: bool) -> None:
    """Refuse ``override(..., propagate=True)`` where the override could not reach new
    processes: a context-local layer, an object another process cannot import by its path,
    or a container whose changes are not written to ``ATTN_DI_REGISTRATIONS`` now.

    Raises:
        InvalidBackendTypeError: ``local=True`` with ``propagate=True``.
        UnexportableBackendError: the class (or test double) has no importable path, or
            automatic propagation would not write it (the reason says which).
    """
    if local:
        raise InvalidBackendTypeError(
            "propagate",
            True,
            "False for a local override (local=True is visible in one thread or task only)",
            hint="drop local=True to override for every thread and the processes started "
            "in the block, or drop propagate=True",
        )
    if target.has_object:
        obj = target.load(member)
        if not isinstance(obj, type):
            reason = (
                f"is a {type(obj).__name__} object (a test double?), not a class another "
                "process can import by its path"
            )
            raise UnexportableBackendError(
                member, target.path, reason, kind="override", noun="object"
            )
        if not resolves_to(target.path, obj):
            reason = "does not import back to the same class in a new process"
            raise UnexportableBackendError(member, target.path, reason, kind="override")
    refusal = PROPAGATION.refusal(container)
    if refusal is not None:
        error = UnexportableBackendError(member, target.path, refusal, kind="override")
        error.hint = (
            "override in the default container with automatic propagation on "
            "(attn_di.set_auto_propagation(True); it is on unless turned off) and no "
            "propagate_registrations() handle active, or register the class instead"
        )
        raise error


def _alive(layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
    """``layers`` without the restored ones."""
    if all(layer.alive for layer in layers):
        return layers
    return tuple(layer for layer in layers if layer.alive)


def _describe(impl: object) -> str:
    return impl if isinstance(impl, str) else getattr(impl, "__qualname__", repr(impl))
