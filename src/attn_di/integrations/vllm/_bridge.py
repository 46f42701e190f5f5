"""The bridge: vLLM's backend registry resolving through attn_di's current container.

:func:`install` replaces, on vLLM's side (``vllm.v1.attention.backends.registry``):

- the members' ``get_path``, ``get_class``, ``is_overridden`` and ``clear_override`` and the
  enums' ``register`` (for ``AttentionBackendEnum`` and ``MambaAttentionBackendEnum``);
- ``register_backend``, and the module dicts ``_ATTN_OVERRIDES`` / ``_MAMBA_ATTN_OVERRIDES``
  (with live views of attn_di's registrations, so code holding vLLM's own
  ``register_backend`` registers in attn_di too);
- the selector's caches (:mod:`attn_di.integrations.vllm._selector`) and the engine's start-up
  checks (there, and :mod:`attn_di.integrations.vllm._workers`: what other processes of the
  engine will run), and adds ``ATTN_DI_`` to vLLM's Ray prefixes;
- the logging record factory and vLLM's engine-client constructors, which carry an attn_di
  error raised in another vLLM process to the process that starts the engine
  (:mod:`attn_di.integrations.vllm._failures`).

On attn_di's side it uses only public hooks: :func:`attn_di.register_enum_alias` (vLLM's
members accepted as attn_di members, vLLM-only names becoming runtime members when first
used), :func:`attn_di.on_member_added` / :func:`attn_di.on_member_removed` (attn_di's runtime
members mirrored into vLLM's enums), :func:`attn_di.remove_runtime_member` and the
container's public methods. :func:`uninstall` puts every replaced object back and vLLM's
member tables as they were, and removes the attn_di runtime members the bridge made for
vLLM-only members (unless they hold a registration).

vLLM's member tables (``_member_map_``, ``_value2member_map_``, ``_member_names_``) are
never emptied and refilled: each change swaps in whole new tables, and while installed the
enums iterate over one snapshot, so ``AttentionBackendEnum["CPU_ATTN"]``,
``AttentionBackendEnum(path)`` and ``list(AttentionBackendEnum)`` in other threads never fail
during install() or uninstall().
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, MutableMapping
from enum import Enum
from typing import Any, ClassVar

import vllm.v1.attention.backends.registry as registry

import attn_di
from attn_di._env import Switch
from attn_di.exceptions import InvalidBackendNameError

__all__ = [
    "BRIDGE_ENV",
    "BRIDGE_SWITCH",
    "Side",
    "install",
    "is_installed",
    "load_plugin",
    "sides",
    "uninstall",
]

BRIDGE_ENV = "ATTN_DI_VLLM_BRIDGE"
"""``ATTN_DI_VLLM_BRIDGE=0`` (or ``false``, ``no``, ``off``) keeps the ``vllm.general_plugins``
entry point from installing; anything but an on/off spelling is refused."""
BRIDGE_SWITCH = Switch(
    BRIDGE_ENV,
    default=True,
    on="install the bridge",
    off="leave vLLM as it is",
)
"""The switch itself, read by :func:`load_plugin`."""

_METHODS = ("get_path", "get_class", "is_overridden", "clear_override", "register")
_logger = logging.getLogger(__name__)
_lock = threading.RLock()


class Side:
    """One of vLLM's backend enums and its attn_di counterpart.

    Attributes:
        vllm_enum: vLLM's enum class.
        attn_di_enum: attn_di's enum of the same family.
        overrides_attr: the name of vLLM's module dict of registrations for this enum.
        mamba: True for the Mamba family (``container.mamba``).
    """

    def __init__(
        self, vllm_enum: type[Enum], attn_di_enum: type[Any], overrides_attr: str, mamba: bool
    ) -> None:
        self.vllm_enum = vllm_enum
        self.attn_di_enum = attn_di_enum
        self.overrides_attr = overrides_attr
        self.mamba = mamba
        self.mirrored: set[str] = set()

    def container(self) -> Any:
        """attn_di's current container (its methods route Mamba members to ``mamba``)."""
        return attn_di.get_container()

    def counterpart(self, vllm_member: Enum) -> Any:
        """attn_di's member of the same name, or None (never created here)."""
        return self.attn_di_enum.__members__.get(vllm_member.name)

    def provider(self, vllm_member: Enum) -> Any:
        """attn_di's provider for ``vllm_member`` in the current container, or None."""
        member = self.counterpart(vllm_member)
        return None if member is None else self.container().provider(member)

    def registered(self, vllm_member: Enum) -> str | None:
        """The path attn_di's current container holds as a registration for ``vllm_member``
        (never creating a member), or None; as in :meth:`overridden`, a runtime member
        valued by another path than vLLM's default counts (a propagated registration)."""
        member = self.counterpart(vllm_member)
        if member is None:
            return None
        path = self.container().registration(member)
        if path is not None:
            return str(path)
        if member.is_runtime and member.default_path != (vllm_member.value or None):
            return str(member.default_path)
        return None

    def overridden(self, vllm_member: Enum) -> bool:
        """Whether attn_di holds a registration or an override for ``vllm_member`` here.

        Also when attn_di's member is a runtime member valued by another path than vLLM's
        default: that is how a registration of a vLLM-only member reaches a worker
        (``ATTN_DI_REGISTRATIONS`` recreates it there as a runtime member of that value)."""
        member = self.counterpart(vllm_member)
        if member is None:
            return False
        if self.container().is_overridden(member):
            return True
        return bool(member.is_runtime and member.default_path != (vllm_member.value or None))


class _Registrations(MutableMapping[Any, str]):
    """vLLM's ``_ATTN_OVERRIDES`` while the bridge is installed: attn_di's registrations.

    ``view[member] = path`` registers in attn_di's current container, ``del view[member]``
    clears it; reading gives the registered path (override blocks are not registrations).
    """

    def __init__(self, side: Side) -> None:
        self._side = side

    def __getitem__(self, member: Any) -> str:
        counterpart = self._side.counterpart(member) if isinstance(member, Enum) else None
        path = None if counterpart is None else self._side.container().registration(counterpart)
        if path is None:
            raise KeyError(member)
        return str(path)

    def __setitem__(self, member: Any, class_path: str) -> None:
        side = self._side
        valueless = isinstance(member, side.vllm_enum) and not member.value
        if valueless and side.counterpart(member) is None:
            # vLLM's own register_backend("NAME") decorator made the member without a path.
            attn_di.register_backend(member.name, class_path, side.mamba)
            side.mirrored.add(member.name)
            return
        side.container().register(member, class_path)

    def __delitem__(self, member: Any) -> None:
        if self.get(member) is None:  # nothing registered: KeyError, as a dict would
            raise KeyError(member)
        self._side.container().clear_override(member)

    def __iter__(self) -> Iterator[Any]:
        return iter([m for m in self._side.vllm_enum if m.name in self._registered_names()])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _registered_names(self) -> set[str]:
        container = self._side.container()
        return {
            member.name
            for member in self._side.attn_di_enum
            if container.registration(member) is not None
        }

    def __repr__(self) -> str:
        return f"<attn_di registrations of {self._side.vllm_enum.__name__}: {dict(self)!r}>"


class _EnumState:
    """What install() changes on one of vLLM's enum classes, to put back on uninstall()."""

    def __init__(self, enum_cls: type[Enum]) -> None:
        self.enum_cls = enum_cls
        self.methods = {name: vars(enum_cls)[name] for name in _METHODS if name in vars(enum_cls)}
        self.member_map = dict(enum_cls._member_map_)
        self.member_names = list(enum_cls._member_names_)
        self.value_map = dict(enum_cls._value2member_map_)
        self.attributes = {
            name: vars(enum_cls)[name] for name in self.member_map if name in vars(enum_cls)
        }

    def restore(self) -> None:
        """Put the methods and member tables back, each table swapped whole (see
        :func:`_swap_tables`): a lookup in another thread never finds one half made."""
        cls = self.enum_cls
        for name, method in self.methods.items():
            type.__setattr__(cls, name, method)
        added = [name for name in cls._member_map_ if name not in self.member_map]
        _swap_tables(cls, list(self.member_names), dict(self.value_map), dict(self.member_map))
        for name in added:
            if isinstance(vars(cls).get(name), cls):
                type.__delattr__(cls, name)
        for name, member in self.attributes.items():
            if vars(cls).get(name) is not member:
                type.__setattr__(cls, name, member)


def _swap_tables(
    cls: type[Enum], names: list[str], values: dict[Any, Any], members: dict[str, Any]
) -> None:
    """Give ``cls`` new member tables, each by one attribute store (atomic under the GIL),
    never by emptying and refilling the old ones: a concurrent ``cls["NAME"]``, ``cls(value)``
    or ``len(cls)`` sees the old table or the new one, and a member in both is found in
    either. The names go first, so an iteration started after this call lists no member the
    map lacks; one started before it is safe through :func:`_snapshot_iter`."""
    type.__setattr__(cls, "_member_names_", names)
    type.__setattr__(cls, "_value2member_map_", values)
    type.__setattr__(cls, "_member_map_", members)


def _snapshot_iter(cls: type[Enum]) -> Iterator[Any]:
    """Enum iteration over one consistent snapshot: the members of the names list and map
    read at the start (each copied in one step), skipping a name the map no longer holds
    (a member being removed). Python's own ``EnumType.__iter__`` looks each name up in the
    map of the moment, so a member removed while it runs raises ``KeyError`` there."""
    names = list(cls._member_names_)
    table = cls._member_map_
    return iter([table[name] for name in names if name in table])


def _snapshot_reversed(cls: type[Enum]) -> Iterator[Any]:
    """``reversed(cls)`` over one snapshot (see :func:`_snapshot_iter`)."""
    return iter(list(_snapshot_iter(cls))[::-1])


class _MetaState:
    """The iteration methods install() gives vLLM's enum metaclass, undone by restore()."""

    _PATCHED: ClassVar[dict[str, Callable[[type[Enum]], Iterator[Any]]]] = {
        "__iter__": _snapshot_iter,
        "__reversed__": _snapshot_reversed,
    }

    def __init__(self, meta: type) -> None:
        self.meta = meta
        self.saved = {name: vars(meta).get(name, _MISSING) for name in self._PATCHED}

    def patch(self) -> None:
        for name, function in self._PATCHED.items():
            type.__setattr__(self.meta, name, function)

    def restore(self) -> None:
        for name, saved in self.saved.items():
            if saved is _MISSING:
                if name in vars(self.meta):
                    type.__delattr__(self.meta, name)
            else:
                type.__setattr__(self.meta, name, saved)


_MISSING = object()


class _Installation:
    """Everything install() did, undone by uninstall()."""

    def __init__(self) -> None:
        attention = Side(
            registry.AttentionBackendEnum, attn_di.AttentionBackendEnum, "_ATTN_OVERRIDES", False
        )
        mamba = Side(
            registry.MambaAttentionBackendEnum,
            attn_di.MambaAttentionBackendEnum,
            "_MAMBA_ATTN_OVERRIDES",
            True,
        )
        self.sides = (attention, mamba)
        self.enum_states = [_EnumState(side.vllm_enum) for side in self.sides]
        metas = dict.fromkeys(type(side.vllm_enum) for side in self.sides)
        self.meta_states = [_MetaState(meta) for meta in metas]
        self.module_attrs = {
            name: getattr(registry, name)
            for name in ("register_backend", *(side.overrides_attr for side in self.sides))
        }
        # attn_di's members before install(): those the bridge creates go on uninstall().
        self.attn_di_names = {side: set(side.attn_di_enum.__members__) for side in self.sides}
        # (container, attn_di member, path) of each registration install() copied from vLLM.
        self.migrated: list[tuple[Any, Any, str]] = []
        self.undo: list[Callable[[], None]] = []


_installation: _Installation | None = None


def is_installed() -> bool:
    """Whether the bridge is installed in this process."""
    return _installation is not None


def sides() -> tuple[Side, ...]:
    """The installed bridge's two sides (attention, Mamba).

    Raises:
        RuntimeError: the bridge is not installed.
    """
    if _installation is None:
        raise RuntimeError("the attn_di vLLM bridge is not installed: call install() first")
    return _installation.sides


def install() -> None:
    """Make vLLM's registry and selector resolve through attn_di's current container.

    Idempotent. vLLM's registrations made before the call (``register_backend`` on vLLM's
    side) become attn_di registrations, except for a member attn_di holds a registration for
    already: attn_di's is kept (it is what ``ATTN_DI_REGISTRATIONS`` carries to the processes
    this one starts) and vLLM's comes back on :func:`uninstall`. attn_di's runtime members get
    vLLM members of the same name. See the package docstring for what is replaced.
    """
    global _installation
    with _lock:
        if _installation is not None:
            return
        state = _installation = _Installation()
        try:
            for meta_state in state.meta_states:
                meta_state.patch()
            for side in state.sides:
                attn_di.register_enum_alias(side.vllm_enum, side.attn_di_enum)
                _migrate(state, side)
                _patch_enum(side)
                setattr(registry, side.overrides_attr, _Registrations(side))
            registry.register_backend = register_backend
            state.undo.append(attn_di.on_member_added(_mirror_added))
            state.undo.append(attn_di.on_member_removed(_mirror_removed))
            from attn_di.integrations.vllm import _failures, _selector, _workers

            # _workers first: its check (what other processes will run) comes before the
            # start-up check's announcement of the backend (_selector wraps it).
            state.undo.append(_workers.install())
            state.undo.append(_selector.install())
            state.undo.append(_failures.install())
            for side in state.sides:
                for member in side.attn_di_enum:
                    _mirror_added(member)
        except BaseException:
            uninstall()  # what was done so far, undone: vLLM as it was
            raise


def uninstall() -> None:
    """Put vLLM back exactly as before :func:`install` (no-op if not installed).

    vLLM's functions, module dicts (with their old contents), enum methods and member tables
    come back; members the bridge added to vLLM's enums go. Registrations made through vLLM
    while installed stay in attn_di's container; those install() copied from vLLM are
    cleared there unless changed since (attn_di's own registration of a member vLLM had
    registered too was never replaced: each side holds its own again). The attn_di runtime
    members made for vLLM-only members while installed go unless they hold a registration,
    an override block or a path of their own: with nothing changed since install(),
    attn_di's members, registrations and ``ATTN_DI_REGISTRATIONS`` are as before it.
    """
    global _installation
    with _lock:
        state = _installation
        if state is None:
            return
        _installation = None
        for undo in reversed(state.undo):
            undo()
        for container, member, class_path in state.migrated:
            if container.registration(member) == class_path:
                container.clear_override(member)
        for side in state.sides:
            attn_di.unregister_enum_alias(side.vllm_enum)
        for name, value in state.module_attrs.items():
            setattr(registry, name, value)
        for enum_state in state.enum_states:
            enum_state.restore()
        for side, enum_state in zip(state.sides, state.enum_states, strict=True):
            _remove_created(side, enum_state, state.attn_di_names[side])
        for meta_state in state.meta_states:  # last: an iteration begun meanwhile stays safe
            meta_state.restore()


def load_plugin() -> None:
    """The ``vllm.general_plugins`` entry point ``attn_di``: install the bridge.

    vLLM calls it once in each of its processes (front end, engine core, workers), after
    ``VLLM_PLUGINS`` allowed it; ``ATTN_DI_VLLM_BRIDGE=0`` leaves vLLM untouched.

    Raises:
        EnvSwitchError: ``ATTN_DI_VLLM_BRIDGE`` holds something other than on/off (vLLM's
            plugin loader lets it through: the process refuses to start, naming it).
    """
    if not BRIDGE_SWITCH.read():
        _logger.info("attn_di: %s is off, the vLLM bridge is not installed", BRIDGE_ENV)
        return
    install()


def register_backend(
    backend: Any, class_path: str | None = None, is_mamba: bool = False
) -> Callable[[Any], Any]:
    """vLLM's ``register_backend`` while the bridge is installed: attn_di's, with vLLM's
    refusals of a new name (an existing name, a reserved one) in vLLM's words."""
    if isinstance(backend, str):
        side = sides()[1 if is_mamba else 0]
        _refuse_like_vllm(side, backend, class_path or "")
        _drop_stale(side, backend)
    if class_path is None:
        return attn_di.register_backend(backend, None, is_mamba)
    return attn_di.register_backend(backend, class_path, is_mamba)


# -- vLLM's enum methods while installed ---------------------------------------------------
def _patch_enum(side: Side) -> None:
    cls = side.vllm_enum
    vllm_get_path = vars(cls)["get_path"]
    vllm_get_class = vars(cls)["get_class"]
    from attn_di.integrations.vllm._selector import record_lookup

    def get_path(self: Enum, include_classname: bool = True) -> str:
        if side.overridden(self):
            path = str(side.container().get_path(side.counterpart(self), include_classname))
        else:
            path = vllm_get_path(self, include_classname)
        record_lookup(side, self, path)
        return path

    def get_class(self: Enum) -> Any:
        if side.overridden(self):
            return side.container().backend(side.counterpart(self))
        return vllm_get_class(self)

    def is_overridden(self: Enum) -> bool:
        return side.overridden(self)

    def clear_override(self: Enum) -> None:
        counterpart = side.counterpart(self)
        if counterpart is not None:
            side.container().clear_override(counterpart)

    def register(enum_cls: type[Enum], name: str, value: str) -> Enum:
        _refuse_like_vllm(side, name, value)
        _drop_stale(side, name)
        if value:  # attn_di's member first: its listener adds vLLM's (_mirror_added)
            side.attn_di_enum.register(name, value)
        if name not in enum_cls._member_map_:  # no path yet (vLLM allows ""): vLLM's side only
            _add_vllm_member(side, name, value)
        return enum_cls._member_map_[name]

    for name, function in (
        ("get_path", get_path),
        ("get_class", get_class),
        ("is_overridden", is_overridden),
        ("clear_override", clear_override),
    ):
        function.__doc__ = getattr(
            vllm_get_path if name == "get_path" else vllm_get_class, "__doc__", None
        )
        function.__qualname__ = f"{cls.__qualname__}.{name}"
        type.__setattr__(cls, name, function)
    register.__qualname__ = f"{cls.__qualname__}.register"
    register.__doc__ = "Add a member (vLLM's API), on vLLM's and attn_di's side at once."
    type.__setattr__(cls, "register", classmethod(register))


def _refuse_like_vllm(side: Side, name: object, value: str) -> None:
    """vLLM's refusals of a new member name, with its phrases (as typed attn_di errors)."""
    cls = side.vllm_enum
    enum_name = cls.__name__
    if not isinstance(name, str):
        raise InvalidBackendNameError(name, "not a string", enum=enum_name)
    if name in cls._member_map_:
        raise InvalidBackendNameError(name, "already exists", existing=name, enum=enum_name)
    if not name.isidentifier() or hasattr(cls, name):
        raise InvalidBackendNameError(
            name, f"not an identifier, or an attribute of {enum_name}", enum=enum_name
        )


def _drop_stale(side: Side, name: str) -> None:
    """Forget attn_di's runtime member ``name`` when vLLM's copy was removed by hand.

    vLLM's tests remove the members they create from the enum's tables directly; the name must
    then be free again on both sides."""
    if name in side.vllm_enum._member_map_ or name not in side.mirrored:
        return
    side.mirrored.discard(name)
    stale = side.attn_di_enum.__members__.get(name)
    if stale is not None:
        attn_di.remove_runtime_member(stale)


def _add_vllm_member(side: Side, name: str, value: str) -> None:
    """Add ``name`` to vLLM's enum as vLLM's own ``register`` does (without its checks)."""
    cls = side.vllm_enum
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    values = dict(cls._value2member_map_)
    values.setdefault(value, member)
    type.__setattr__(cls, name, member)
    # New tables, never the old ones grown: an iteration begun before (which holds the old
    # names list) never meets this member, so its removal later cannot fail that iteration.
    # The map first: a name listed is always in the map.
    type.__setattr__(cls, "_member_map_", {**cls._member_map_, name: member})
    type.__setattr__(cls, "_value2member_map_", values)
    type.__setattr__(cls, "_member_names_", [*cls._member_names_, name])
    side.mirrored.add(name)


def _mirror_added(member: Any) -> None:
    """attn_di added a runtime member: vLLM's enum of the same family gets one too."""
    state = _installation
    if state is None:
        return
    for side in state.sides:
        if isinstance(member, side.attn_di_enum):
            name = member.name
            if name in side.vllm_enum._member_map_ or not member.is_runtime:
                return
            if hasattr(side.vllm_enum, name):
                _logger.warning(
                    "attn_di: runtime member %s has no twin in vLLM's %s (the name is an "
                    "attribute there)", name, side.vllm_enum.__name__,
                )  # fmt: skip
                return
            _add_vllm_member(side, name, member.value)


def _mirror_removed(member: Any) -> None:
    """attn_di removed a runtime member: remove the vLLM member the bridge added for it."""
    state = _installation
    if state is None:
        return
    for side in state.sides:
        if isinstance(member, side.attn_di_enum) and member.name in side.mirrored:
            side.mirrored.discard(member.name)
            cls = side.vllm_enum
            twin = cls._member_map_.get(member.name)
            if twin is None:
                return
            values = {v: m for v, m in cls._value2member_map_.items() if m is not twin}
            names = [name for name in cls._member_names_ if name != member.name]
            members = {n: m for n, m in cls._member_map_.items() if n != member.name}
            _swap_tables(cls, names, values, members)
            if vars(cls).get(member.name) is twin:
                type.__delattr__(cls, member.name)


def _migrate(state: _Installation, side: Side) -> None:
    """vLLM's registrations made before install() become attn_di registrations, unless
    attn_di holds one for the member (attn_di's wins; vLLM's dict keeps its own, for
    uninstall()); attn_di's runtime members vLLM already has count as mirrored."""
    overrides: dict[Any, str] = getattr(registry, side.overrides_attr)
    for member, class_path in list(overrides.items()):
        if not (isinstance(member, side.vllm_enum) and isinstance(class_path, str) and class_path):
            continue
        kept = side.registered(member)
        if kept is not None:
            if kept != class_path:
                _logger.warning(
                    "attn_di: %s is registered on both sides: attn_di's %s is kept while the "
                    "bridge is installed (vLLM's %s comes back on uninstall())",
                    member.name, kept, class_path,
                )  # fmt: skip
            continue
        container = side.container()
        container.register(member, class_path)
        state.migrated.append((container, side.counterpart(member), class_path))
    for member in side.attn_di_enum:
        if member.is_runtime and member.name in side.vllm_enum.__members__:
            side.mirrored.add(member.name)


def _remove_created(side: Side, enum_state: _EnumState, names_before: set[str]) -> None:
    """Remove the attn_di runtime members made, while installed, for vLLM-only members
    (``register_enum_alias`` creates them on first use) that hold nothing of their own: no
    registration or override block in the current container, valued by vLLM's default
    path."""
    container = side.container()
    for member in side.attn_di_enum:
        vllm_member = enum_state.member_map.get(member.name)
        if (
            member.name in names_before
            or vllm_member is None
            or not member.is_runtime
            or member.default_path != (vllm_member.value or None)
            or container.is_overridden(member)
        ):
            continue
        attn_di.remove_runtime_member(member)
