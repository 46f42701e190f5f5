"""Out-of-tree backends: plugins in the ``attn_di.plugins`` entry-point group.

A plugin is a zero-argument callable, named by an entry point of an installed distribution,
that registers backends (``register_backend(...)``, runtime members included).
:func:`load_plugins` calls each plugin once per process, honouring the ``ATTN_DI_PLUGINS``
allowlist, and records which distribution provided which registrations
(:func:`plugin_report`, shown by ``attn-di list``). A plugin that raises, anything
including ``SystemExit`` and other ``BaseException``s, is logged with its traceback and
reported as failed, and everything it changed is rolled back: its partial registrations,
the members it created, the runtime members it removed (the same objects come back, in their
place, with their providers in every container), the override layers it opened, the
listeners it subscribed or dropped (``on_member_added``, ``on_member_removed``), the enum
aliases it registered or dropped (``register_enum_alias``) and what it changed through
dependency-injector itself (provider and container overrides, the configuration, wiring);
none of its listeners runs during the rollback. The others still load, and it is not run
again. A ``KeyboardInterrupt`` is rolled back and recorded the same way, then re-raised (the
user asked to stop): the plugins not reached yet are named in a warning and load at the next
:func:`load_plugins`.

Entry points are only read when :func:`load_plugins` is called, never at ``import attn_di``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from traceback import format_exception
from typing import TYPE_CHECKING, Any, Literal

from attn_di._container import BackendContainer, RuntimeProviders
from attn_di._default import get_container
from attn_di._family import BackendEnum, BackendFamily, Subscriptions, families, family_of
from attn_di._propagation import PLUGINS_ENV
from attn_di._provider import Target
from attn_di._state import LOCAL_LAYERS, REGISTRY_LOCK, notify_quietly

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "PLUGIN_GROUP",
    "PluginRecord",
    "PluginReport",
    "isolated_plugin_state",
    "load_plugins",
    "plugin_report",
]

PLUGIN_GROUP = "attn_di.plugins"
"""The entry-point group of attn_di plugins."""

PluginStatus = Literal["loaded", "failed", "skipped"]

logger = logging.getLogger("attn_di.plugins")


@dataclass(frozen=True)
class PluginRecord:
    """One plugin entry point and what became of it.

    Attributes:
        name: the entry point's name (what ``ATTN_DI_PLUGINS`` lists).
        value: the entry point's target, ``module:callable``.
        distribution: the name of the distribution that provides it (None if unknown).
        version: that distribution's version (None if unknown).
        status: "loaded", "failed" (see :attr:`error`), or "skipped" (not allowlisted).
        members: names of the members it registered or created, in enum order.
        error: ``"ExceptionType: message"`` for a failed plugin.
        traceback: the formatted traceback of a failed plugin.
    """

    name: str
    value: str
    distribution: str | None
    version: str | None
    status: PluginStatus
    members: tuple[str, ...] = ()
    error: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class PluginReport:
    """What :func:`load_plugins` found, loaded, skipped and saw fail in this process.

    Attributes:
        plugins: every record: loaded and failed ones in load order, then skipped ones.
        allowlist: the names ``ATTN_DI_PLUGINS`` allowed at the last load (None: all).
        missing: allowlisted names that no installed entry point has.
    """

    plugins: tuple[PluginRecord, ...] = ()
    allowlist: tuple[str, ...] | None = None
    missing: tuple[str, ...] = field(default=())

    @property
    def loaded(self) -> tuple[PluginRecord, ...]:
        """The plugins that ran without error."""
        return tuple(p for p in self.plugins if p.status == "loaded")

    @property
    def failed(self) -> tuple[PluginRecord, ...]:
        """The plugins that raised (nothing of theirs is kept)."""
        return tuple(p for p in self.plugins if p.status == "failed")

    @property
    def skipped(self) -> tuple[PluginRecord, ...]:
        """The plugins left out by ``ATTN_DI_PLUGINS``."""
        return tuple(p for p in self.plugins if p.status == "skipped")

    def origin(self, member: BackendEnum | str) -> PluginRecord | None:
        """The loaded plugin that last registered ``member`` (a member or its name), if any.

        Names are recorded as the exported snapshots write them: ``"CUSTOM"`` for an
        attention member, ``"mamba:CUSTOM"`` for a Mamba member."""
        name = _qualified(member) if isinstance(member, BackendEnum) else member
        for record in reversed(self.loaded):
            if name in record.members:
                return record
        return None


class _PluginState:
    def __init__(self) -> None:
        self.done: dict[tuple[str | None, str], PluginRecord] = {}
        self.running: set[tuple[str | None, str]] = set()  # a plugin calling load_plugins()
        self.report = PluginReport()


_state = _PluginState()
_lock = threading.RLock()


def load_plugins() -> PluginReport:
    """Call every installed ``attn_di.plugins`` entry point once per process.

    ``ATTN_DI_PLUGINS`` (comma-separated entry-point names) restricts which are loaded;
    unset means all, empty means none. A later call loads only plugins not loaded before
    (e.g. newly allowed), so calling it again is harmless. Registrations go to the default
    container; each loaded plugin's are recorded with the source "plugin".

    Returns:
        The report of this process (also :func:`plugin_report`).
    """
    with _lock:
        allowlist = _read_allowlist()
        if allowlist is not None:
            logger.info("%s allows the plugins %s", PLUGINS_ENV, list(allowlist))
        skipped: list[PluginRecord] = []
        found: set[str] = set()
        for entry_point in _entry_points():
            found.add(entry_point.name)
            key = (_distribution(entry_point)[0], entry_point.name)
            if key in _state.done or key in _state.running:
                continue
            if allowlist is not None and entry_point.name not in allowlist:
                logger.debug("skipping plugin %r: not in %s", entry_point.name, PLUGINS_ENV)
                skipped.append(_record(entry_point, "skipped"))
                continue
            _state.running.add(key)
            try:
                _state.done[key] = _load(entry_point, get_container())
            except KeyboardInterrupt:
                _state.done[key] = _record(entry_point, "failed", error="KeyboardInterrupt")
                _state.report = PluginReport((*_state.done.values(), *skipped), allowlist)
                logger.warning(
                    "loading attn_di plugins interrupted in %r (rolled back); the plugins not "
                    "reached yet load at the next load_plugins()",
                    entry_point.name,
                )
                raise
            finally:
                _state.running.discard(key)
        missing = tuple(name for name in allowlist or () if name not in found)
        for name in missing:
            logger.warning("%s names %r, but no such plugin is installed", PLUGINS_ENV, name)
        _state.report = PluginReport((*_state.done.values(), *skipped), allowlist, missing)
        return _state.report


def plugin_report() -> PluginReport:
    """The report of the last :func:`load_plugins` in this process (empty before any)."""
    return _state.report


@contextmanager
def isolated_plugin_state() -> Iterator[None]:
    """Forget which plugins were loaded for a block, then restore that (for test isolation)."""
    with _lock:
        saved = _state.done, _state.running, _state.report
        _state.done, _state.running, _state.report = {}, set(), PluginReport()
    try:
        yield
    finally:
        with _lock:
            _state.done, _state.running, _state.report = saved


# -- helpers ------------------------------------------------------------------------------
def _read_allowlist() -> tuple[str, ...] | None:
    value = os.environ.get(PLUGINS_ENV)
    if value is None:
        return None
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _entry_points() -> list[EntryPoint]:
    from importlib.metadata import entry_points  # scanned here only, never at import

    return list(entry_points(group=PLUGIN_GROUP))


def _distribution(entry_point: EntryPoint) -> tuple[str | None, str | None]:
    dist = entry_point.dist
    if dist is None:
        return None, None
    return dist.name, dist.version


def _record(
    entry_point: EntryPoint,
    status: PluginStatus,
    members: tuple[str, ...] = (),
    error: str | None = None,
    traceback: str | None = None,
) -> PluginRecord:
    name, version = _distribution(entry_point)
    return PluginRecord(
        entry_point.name, entry_point.value, name, version, status, members, error, traceback
    )


def _load(entry_point: EntryPoint, container: BackendContainer) -> PluginRecord:
    before = _Before(container)
    where = _distribution(entry_point)[0] or "an unknown distribution"
    try:
        plugin = entry_point.load()
        if not callable(plugin):
            raise TypeError(f"{entry_point.value} is not callable: {plugin!r}")
        plugin()
    except BaseException as error:  # SystemExit and friends too: a plugin never ends the host
        _roll_back(container, before)
        logger.error(
            "attn_di plugin %r from %s failed; its registrations, members and overrides "
            "were rolled back",
            entry_point.name,
            where,
            exc_info=error,
        )
        if isinstance(error, KeyboardInterrupt):
            raise
        return _record(
            entry_point,
            "failed",
            error=f"{type(error).__name__}: {error}",
            traceback="".join(format_exception(error)),
        )
    members = _attribute(container, before.registrations)
    logger.info(
        "loaded attn_di plugin %r from %s (registered %s)",
        entry_point.name,
        where,
        ", ".join(members) or "nothing",
    )
    return _record(entry_point, "loaded", members=members)


def _qualified(member: BackendEnum) -> str:
    """The member's name as snapshots write it (``"mamba:CUSTOM"`` outside the attention enum)."""
    family = family_of(member)
    return member.name if family is families()[0] else f"{family.key}:{member.name}"


def _registrations(container: BackendContainer) -> dict[str, Target | None]:
    return {_qualified(p.member): p._registered for p in container.all_providers()}


def _attribute(container: BackendContainer, before: dict[str, Target | None]) -> tuple[str, ...]:
    """Mark what a plugin registered or created with the source "plugin"; return the names."""
    names: list[str] = []
    for provider in container.all_providers():
        name = _qualified(provider.member)
        target = provider._registered
        if name not in before:  # a runtime member the plugin created
            target = target or provider._default
        elif target is None or target is before.get(name):
            continue
        if target is not None:
            target.source = "plugin"
        names.append(name)
    return tuple(names)


class _Before:
    """What a plugin may change, as it is before the plugin runs (what :func:`_roll_back`
    returns to)."""

    def __init__(self, container: BackendContainer) -> None:
        self.registrations = _registrations(container)
        self.members: dict[BackendFamily, tuple[BackendEnum, ...]] = {
            family: family.members() for family in families()
        }
        self.providers = RuntimeProviders()
        self.layers = {p: list(p._layers) for p in container.all_providers()}
        self.local = LOCAL_LAYERS.get()
        self.subscriptions = Subscriptions()
        self.di = _DIState.of(container)


class _DIState:
    """What dependency-injector itself holds for a container, to restore after a failed
    plugin: every provider's override stack (``container.CPU_ATTN.override(...)``,
    ``container.candidates.override(...)``, ``container.attention.from_dict(...)``, which
    overrides the configuration), the container overrides (``container.override(other)``)
    of the container and its sub-containers, and the modules and packages it is wired to."""

    def __init__(self, container: BackendContainer) -> None:
        self.container: Any = container  # dependency-injector's own API is untyped
        self.containers: list[Any] = [sub for _, sub in container._families()]
        self.container_stacks = [tuple(sub.overridden) for sub in self.containers]
        every: list[Any] = list(self.container.traverse())
        self.provider_stacks = {provider: tuple(provider.overridden) for provider in every}
        self.modules = list(container.wired_to_modules)
        self.packages = list(container.wired_to_packages)

    @classmethod
    def of(cls, container: BackendContainer) -> _DIState:
        """The state of ``container`` now."""
        return cls(container)

    def restore(self) -> None:
        """Undo every override and wiring made since :meth:`of` (and re-apply any the plugin
        removed), container overrides first (they override providers themselves)."""
        for sub, stack in zip(self.containers, self.container_stacks, strict=True):
            while len(sub.overridden) > len(stack) or _diverged(sub.overridden, stack):
                sub.reset_last_overriding()
            for overriding in stack[len(sub.overridden) :]:
                sub.override(overriding)
        every: list[Any] = list(self.container.traverse())
        for provider in every:
            stack = self.provider_stacks.get(provider, ())
            while len(provider.overridden) > len(stack) or _diverged(provider.overridden, stack):
                provider.reset_last_overriding()
            for overriding in stack[len(provider.overridden) :]:
                provider.override(overriding)
        container = self.container
        if container.wired_to_modules != self.modules or container.wired_to_packages != (
            self.packages
        ):
            container.unwire()
            if self.modules or self.packages:
                container.wire(modules=self.modules, packages=self.packages)


def _diverged(current: tuple[object, ...], kept: tuple[object, ...]) -> bool:
    """Whether ``current`` is not a prefix of ``kept`` (compared by identity)."""
    return any(a is not b for a, b in zip(current, kept, strict=False))


def _roll_back(container: BackendContainer, before: _Before) -> None:
    # The plugin's listeners go first: none of its code runs during the rollback.
    before.subscriptions.restore()
    for family, members in before.members.items():
        kept = set(members)
        for member in family.runtime_members():
            if member not in kept:
                family.remove_member(member, notify=False, quiet=True)
        before.providers.restore(family.restore_members(members))
    with REGISTRY_LOCK:
        for provider in container.all_providers():
            previous = before.registrations.get(_qualified(provider.member))
            if provider._registered is not previous:
                provider.set_registration(previous)
            kept_layers = before.layers.get(provider, [])
            for layer, _ in list(provider._layers):
                if all(layer is not old for old, _ in kept_layers):
                    layer.alive = False
                    provider.remove_layer(layer)
        for layer in LOCAL_LAYERS.get():
            if layer not in before.local:
                layer.alive = False
    LOCAL_LAYERS.set(before.local)
    before.di.restore()
    # The environment snapshot too, once everything is back (a warning raised as an error
    # there must not stop the rollback half-way).
    notify_quietly(None)
