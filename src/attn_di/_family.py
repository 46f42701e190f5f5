"""The generic mechanism behind every backend enum: :class:`BackendEnum` (the members'
methods) and :class:`BackendFamily` (one enum's runtime members, names and lookups).

vLLM keeps two enums with one API: ``AttentionBackendEnum`` and ``MambaAttentionBackendEnum``
(``vllm/v1/attention/backends/registry.py``). Here both are instances of this mechanism
(:mod:`attn_di._enum` declares them); a third needs an enum class, a :class:`BackendFamily`
and a container class (:mod:`attn_di._container`). Families never see each other's names.

Member tables are changed under :data:`attn_di._state.REGISTRY_LOCK`; readers take
snapshots (``tuple(dict)``, one C call, retried in the rare case a garbage collection during it
let another thread change the table: :func:`attn_di._state.snapshot`), so iterating,
exporting or parsing while another thread adds members never fails. vLLM's tests remove
runtime members by hand (popping ``_member_map_``, ``_member_names_`` and the class
attribute): everything here reads the enum's own tables, so such removals and a later
re-registration of the name work.
"""

from __future__ import annotations

import contextlib
import keyword
import re
import warnings
from collections.abc import Callable, Iterator
from enum import Enum, EnumMeta
from typing import Any, TypeVar, cast

from attn_di._paths import check_class_path
from attn_di._state import (
    DEFAULT,
    LOCAL_LAYERS,
    REGISTRY_LOCK,
    notify_quietly,
    notify_registrations_changed,
    snapshot,
    user_stacklevel,
)
from attn_di.exceptions import (
    AttnDIWarning,
    BackendNotRegisteredError,
    InvalidBackendNameError,
    InvalidBackendTypeError,
    UnknownBackendError,
)

__all__ = [
    "BackendEnum",
    "BackendEnumMeta",
    "BackendFamily",
    "Subscriptions",
    "families",
    "family_of",
    "is_alias_member",
    "native_member",
    "on_member_added",
    "on_member_removed",
    "register_enum_alias",
    "spelling",
    "unregister_enum_alias",
]

_E = TypeVar("_E", bound="BackendEnum")
_local_layers = LOCAL_LAYERS.get  # bound once: the warm path of get_class() calls it
_FAMILIES: dict[type[Any], BackendFamily] = {}
_SEPARATORS = re.compile(r"[\s-]+")
_new_listeners: list[Callable[[BackendEnum], None]] = []
_removed_listeners: list[Callable[[BackendEnum], None]] = []
# Another project's enum class -> the family whose members its members stand for.
_ALIASES: dict[type[Any], BackendFamily] = {}


class BackendEnumMeta(EnumMeta):
    """EnumMeta whose ``Enum["X"]`` raises :class:`UnknownBackendError` (a ValueError) and whose
    iteration works on a snapshot (safe while other threads add members)."""

    def __getitem__(cls, name: str) -> Any:
        try:
            return cls._member_map_[name]
        except (KeyError, TypeError):
            raise family_of(cls).unknown(name) from None

    def __iter__(cls) -> Iterator[Any]:
        return iter(snapshot(lambda: tuple(cls._member_map_.values())))


class BackendEnum(Enum, metaclass=BackendEnumMeta):
    """Base of the backend enums: a member's value is its default dotted class path.

    The registry methods act on the default container (:func:`attn_di.get_container`).
    """

    # Members are singletons: identity hashing is correct and C-fast (Enum's is Python code).
    __hash__ = object.__hash__

    def __reduce_ex__(self, protocol: object) -> tuple[Callable[..., BackendEnum], tuple[Any, ...]]:
        # By name, not by value: runtime members may share a value with another member.
        return _member_by_name, (type(self), self._name_)

    @classmethod
    def _missing_(cls, value: object) -> Any:
        # Enum("...") looks members up by default class path.
        raise family_of(cls).unknown(value, looked_up="class path")

    @property
    def is_runtime(self) -> bool:
        """True for a member added at runtime (``register``, ``register_backend("NAME")``,
        ``ATTN_DI_REGISTRATIONS``), False for one declared in the enum."""
        return self._name_ not in family_of(self).builtin

    @property
    def default_path(self) -> str | None:
        """The member's default class path, or None (CUSTOM)."""
        return self._value_ or None

    def get_path(self, include_classname: bool = True) -> str:
        """The class path this member resolves to in the default container.

        Overrides first, then the registration, then the default (the member's value).

        Args:
            include_classname: False returns only the module part.

        Raises:
            BackendNotRegisteredError: the member has no path (CUSTOM before registration).
        """
        return DEFAULT.get().get_path(self, include_classname)  # type: ignore[no-any-return]

    def get_class(self) -> type[Any]:
        """Import (lazily, once) and return the class this member resolves to.

        Respects context-local overrides, override blocks and registrations, in that order.

        Raises:
            BackendNotRegisteredError: the member has no path (CUSTOM before registration).
            BackendImportError: the path does not import, or names something that is not a class.
        """
        if not _local_layers():
            try:  # the default container's warm-path cache
                return DEFAULT.current._resolved[self]  # type: ignore[no-any-return]
            except (KeyError, AttributeError):  # not resolved yet; no default container yet
                pass
        return DEFAULT.get().backend(self)  # type: ignore[no-any-return]

    def is_overridden(self) -> bool:
        """True while a registration or an override (global or local) is active."""
        return DEFAULT.get().is_overridden(self)  # type: ignore[no-any-return]

    def clear_override(self) -> None:
        """Forget the registration, returning to the member's value. No-op if none.

        Override blocks (``with container.override(...)``) are not touched: they end themselves.
        """
        DEFAULT.get().clear_override(self)

    @classmethod
    def register(cls: type[_E], name: str, value: str) -> _E:
        """Add a member at runtime whose value (default class path) is ``value``.

        Every container, existing or future, gets a provider for it. Members are process-wide.

        Args:
            name: a Python identifier that is not a member yet, does not start with ``_`` and
                does not shadow an attribute of the enum or of a container (lower case is fine).
            value: a dotted class path (not imported now).

        Returns:
            The new member.

        Raises:
            InvalidBackendNameError: "Invalid or reserved backend name", or the name
                "already exists" (nothing changes).
            InvalidClassPathError: the path is malformed (nothing changes).
            InvalidBackendTypeError: name or value is not a string.
        """
        return cast("_E", family_of(cls).add_member(name, value))


class BackendFamily:
    """One backend enum and the rules of its names.

    Attributes:
        enum: the enum class.
        key: a short lower-case key (``"attention"``, ``"mamba"``): the prefix of this
            family's names in exported snapshots, and the container attribute of its
            sub-container (except for the primary family).
        label: what a member is called in messages (``"attention backend"``).
        unknown_phrase: how the error for an unknown name begins (``"Unknown attention
            backend"``): ``"Unknown <label>"`` unless the family keeps another project's
            wording that callers match on.
        builtin: the names declared in the enum's body.
        reserved: names that would shadow an attribute of the enum or of a container
            (containers add theirs when their module is imported).
    """

    def __init__(
        self, enum: type[BackendEnum], key: str, label: str, unknown_phrase: str | None = None
    ) -> None:
        self.enum = enum
        self.key = key
        self.label = label
        self.unknown_phrase = unknown_phrase or f"Unknown {label}"
        self.builtin = frozenset(enum._member_map_)
        namespaces = [*type.mro(enum), *type.mro(type(enum))]
        self.reserved: set[str] = {name for space in namespaces for name in vars(space)}
        _FAMILIES[enum] = self

    # -- reading (snapshots: safe while other threads add members) ----------------------
    def names(self) -> tuple[str, ...]:
        """Every member name, in enum order."""
        return snapshot(lambda: tuple(self.enum._member_map_))

    def members(self) -> tuple[Any, ...]:
        """Every member, in enum order."""
        return snapshot(lambda: tuple(self.enum._member_map_.values()))

    def runtime_members(self) -> list[Any]:
        """The members added at runtime, oldest first."""
        return [m for m in self.members() if m._name_ not in self.builtin]

    def lookup(self, key: object) -> Any:
        """The member for a member of this enum or its exact name (pickles, vLLM's
        ``Enum["X"]`` semantics); :meth:`find` reads the spellings users type.

        Raises:
            UnknownBackendError: anything else (a ValueError), with the closest name.
        """
        key = native_member(key)
        if isinstance(key, self.enum):
            return key
        member = self.enum._member_map_.get(key) if isinstance(key, str) else None
        if member is None:
            raise self.unknown(key)
        return member

    def find(self, name: str) -> Any:
        """The member a name as typed by a user spells, or None: the name rule.

        The exact name wins; otherwise :func:`spelling` (surrounding spaces dropped, inner
        spaces and hyphens read as ``_``) is matched exactly, then case-insensitively. So
        ``"cpu_attn"``, ``"CPU-ATTN"`` and ``"torch sdpa"`` find their members, and runtime
        members differing only by case (``"Mine"``, ``"MINE"``) stay reachable by their exact
        names.

        Raises:
            UnknownBackendError: the spelling matches several members that differ only by
                case (the hint names them: give the exact name).
        """
        members = self.enum._member_map_
        member = members.get(name)
        if member is not None:
            return member
        text = spelling(name)
        member = members.get(text)
        if member is not None:
            return member
        folded = text.upper()
        items = snapshot(lambda: tuple(members.items()))
        matches = [m for key, m in items if key.upper() == folded]
        if len(matches) > 1:
            error = self.unknown(name)
            error.suggestion = None
            error.hint = (
                f"{name!r} matches {', '.join(repr(m._name_) for m in matches)}, which differ "
                "only by case: give the exact name"
            )
            raise error
        return matches[0] if matches else None

    def parse(self, name: object) -> Any:
        """Parse a name as typed by a user (the name rule of :meth:`find`); ``None``, ``""``
        and ``"auto"`` (any case) give None; a member is returned as is.

        Raises:
            UnknownBackendError: an unknown name, with the closest suggestion.
            InvalidBackendTypeError: neither a string nor a member.
        """
        name = native_member(name)
        if name is None or isinstance(name, self.enum):
            return name
        if not isinstance(name, str):
            raise InvalidBackendTypeError(
                "backend", name, f"a backend name or a {self.enum.__name__} member"
            )
        if spelling(name).lower() in ("", "auto"):
            return None
        member = self.find(name)
        if member is None:
            raise self.unknown(name, extra=("auto",))
        return member

    def unknown(
        self, name: object, *, looked_up: str = "name", extra: tuple[str, ...] = ()
    ) -> UnknownBackendError:
        """The error for an unknown name (not raised)."""
        return UnknownBackendError(
            name,
            [*self.names(), *extra],
            looked_up=looked_up,
            enum=self.enum.__name__,
            phrase=self.unknown_phrase,
        )

    # -- runtime members ----------------------------------------------------------------
    def check_new_name(self, name: object) -> str:
        """Validate a new member's name.

        Raises:
            InvalidBackendTypeError: not a string.
            InvalidBackendNameError: not an identifier, reserved, or already a member.
        """
        self.check_name_form(name)
        assert isinstance(name, str)
        if name in self.enum._member_map_:
            raise InvalidBackendNameError(
                name, "already exists", existing=name, enum=self.enum.__name__
            )
        return name

    def check_name_form(self, name: object) -> str:
        """Validate what a runtime member's name may be, whether or not it exists yet.

        Raises:
            InvalidBackendTypeError: not a string.
            InvalidBackendNameError: not an identifier, starts with ``_``, or reserved.
        """
        if not isinstance(name, str):
            raise InvalidBackendTypeError("name", name, "a member name string")
        if not name.isidentifier() or keyword.iskeyword(name):
            raise InvalidBackendNameError(name, "not a Python identifier", enum=self.enum.__name__)
        if name.startswith("_"):
            raise InvalidBackendNameError(
                name, "names starting with '_' are reserved", enum=self.enum.__name__
            )
        if name in self.reserved and name not in self.enum._member_map_:
            raise InvalidBackendNameError(
                name,
                f"it would shadow an attribute of {self.enum.__name__} or of a container",
                enum=self.enum.__name__,
            )
        return name

    def add_member(
        self, name: str, class_path: str, default_cls: object = None, *, alias: bool = False
    ) -> Any:
        """Add a runtime member valued ``class_path`` (see :meth:`BackendEnum.register`).

        The member and its providers in every container appear together: a thread that
        sees the name in the enum finds its providers too.

        Args:
            default_cls: the class the path names, when already at hand (a decorated class,
                possibly defined in a function): containers resolve to it without importing.
            alias: the member stands for another project's member (:func:`native_member`):
                its value is that project's default, which is not exported (see
                :func:`is_alias_member`).

        Raises:
            InvalidBackendNameError, InvalidClassPathError, InvalidBackendTypeError: nothing
                changes. So does an error raised by a warning (``-W error``: a name that
                differs from another only by case) or by a listener of the change.
        """
        member, created = self.ensure_member(
            name, class_path, default_cls, exist_ok=False, alias=alias
        )
        assert created
        self.announce_member(member)
        return member

    def ensure_member(
        self,
        name: str,
        class_path: str,
        default_cls: object = None,
        *,
        exist_ok: bool = True,
        alias: bool = False,
    ) -> tuple[Any, bool]:
        """The member named ``name``, created (valued ``class_path``) if there is none:
        ``(member, created)``. Atomic: of threads ensuring one name at once, one creates it
        and the others get that member. Listeners of registration changes are not told
        (the caller does, with :meth:`announce_member` or its own notification).

        Warns (before anything changes) when the new name differs from another only by case.

        Raises:
            InvalidBackendNameError: a name a member cannot have; with ``exist_ok=False``,
                also a name that exists ("already exists"). Nothing changes.
            InvalidClassPathError, InvalidBackendTypeError: nothing changes.
        """
        if not isinstance(class_path, str):
            raise InvalidBackendTypeError("class_path", class_path, "a dotted path string")
        if default_cls is None:  # a class at hand may live in a function (a ``<locals>`` path)
            check_class_path(class_path)
        with REGISTRY_LOCK:
            existing = self.enum._member_map_.get(name) if isinstance(name, str) else None
            if existing is not None and exist_ok:
                return existing, False
            self.check_new_name(name)
            upper = name.upper()
            same = [n for n in self.names() if n.upper() == upper]
            if same:  # decided before the change: an error filter leaves nothing behind
                warnings.warn(
                    f"new {self.label} {name!r} differs from {same[0]!r} only by case",
                    AttnDIWarning,
                    stacklevel=user_stacklevel(),
                )
            member = self._new(name, class_path)
            if default_cls is not None:
                member._default_cls_ = default_cls
            if alias:
                member._alias_of_foreign_ = True
            try:
                for listener in list(_new_listeners):
                    listener(member)
            except BaseException:
                for listener in list(_removed_listeners):
                    listener(member)
                raise
            self._publish(member)
        return member, True

    def announce_member(self, member: BackendEnum) -> None:
        """Tell the listeners of registration changes that ``member`` was created; if one
        raises (a warning turned into an error), the member is removed again and the error
        re-raised."""
        try:
            notify_registrations_changed(None)
        except BaseException:
            self.remove_member(member, notify=False)
            notify_quietly(None)
            raise

    def remove_member(
        self, member: BackendEnum, *, notify: bool = True, quiet: bool = False
    ) -> None:
        """Remove a runtime member and its providers (test isolation; built-ins are kept).

        A member already removed by hand (as vLLM's tests do) only loses its providers.
        With ``quiet`` (a rollback), a removal listener that raises an ``Exception`` does not
        stop the others or the removal.

        Raises:
            InvalidBackendNameError: ``member`` is a built-in member.
        """
        cls = self.enum
        if member._name_ in self.builtin:
            raise InvalidBackendNameError(
                member._name_, "built-in members cannot be removed", enum=cls.__name__
            )
        with REGISTRY_LOCK:
            if cls._member_map_.get(member._name_) is member:
                del cls._member_map_[member._name_]
                cls._member_names_.remove(member._name_)
                if vars(cls).get(member._name_) is member:
                    type.__delattr__(cls, member._name_)
            if cls._value2member_map_.get(member._value_) is member:
                del cls._value2member_map_[member._value_]
            for listener in list(_removed_listeners):
                if quiet:
                    with contextlib.suppress(Exception):
                        listener(member)
                else:
                    listener(member)
        if notify:
            notify_registrations_changed(None)

    def restore_members(self, members: tuple[Any, ...]) -> list[Any]:
        """Put back the runtime members of ``members`` (this enum's :meth:`members` at an
        earlier moment) that were removed since: the very objects, in that order, the
        listeners of new members told first (a failed plugin's rollback). A name another
        member holds now is left to it.

        A listener that raises (an ``Exception``) does not stop the others or the restore.

        Returns:
            The members put back, oldest first.
        """
        cls = self.enum
        restored = []
        with REGISTRY_LOCK:
            for member in members:
                if member._name_ in self.builtin or member._name_ in cls._member_map_:
                    continue
                for listener in list(_new_listeners):
                    with contextlib.suppress(Exception):
                        listener(member)
                self._publish(member)
                restored.append(member)
            if restored:
                self._reorder([member._name_ for member in members])
        return restored

    def _reorder(self, names: list[str]) -> None:
        """Order the enum's tables as ``names`` (names not in it last, as they are): one
        swap of the member map, so a reader never misses a member."""
        cls = self.enum
        current = cls._member_map_
        position = {name: index for index, name in enumerate(names)}
        order = sorted(current, key=lambda name: position.get(name, len(names)))
        if order == list(current):
            return
        type.__setattr__(cls, "_member_map_", {name: current[name] for name in order})
        cls._member_names_[:] = sorted(
            cls._member_names_, key=lambda name: position.get(name, len(names))
        )

    def _new(self, name: str, class_path: str) -> Any:
        """A member object, not yet in the enum's tables (see :meth:`_publish`)."""
        member = object.__new__(self.enum)
        member._name_ = name
        member._value_ = class_path
        member._sort_order_ = len(self.enum._member_names_)  # type: ignore[attr-defined]
        return member

    def _publish(self, member: Any) -> None:
        """Put a member made by :meth:`_new` into the enum's tables."""
        cls, name, class_path = self.enum, member._name_, member._value_
        add_member = getattr(cls, "_add_member_", None)  # Python >= 3.13
        if add_member is not None:
            add_member(name, member)
        else:
            type.__setattr__(cls, name, member)
            cls._member_map_[name] = member
            cls._member_names_.append(name)
        stale = cls._value2member_map_.get(class_path)
        if stale is None or cls._member_map_.get(stale._name_) is not stale:
            cls._value2member_map_[class_path] = member

    def __repr__(self) -> str:
        return f"<BackendFamily {self.key}: {self.enum.__name__}>"


def spelling(name: str) -> str:
    """``name`` as the name rule reads it: surrounding spaces dropped, inner runs of spaces
    and hyphens read as one ``_`` (``" torch-sdpa "`` -> ``"torch_sdpa"``); case is kept."""
    return _SEPARATORS.sub("_", name.strip())


def family_of(enum_or_member: object) -> BackendFamily:
    """The family of an enum class or of one of its members.

    Raises:
        InvalidBackendTypeError: neither.
    """
    cls = enum_or_member if isinstance(enum_or_member, type) else type(enum_or_member)
    family = _FAMILIES.get(cls)
    if family is None:
        raise InvalidBackendTypeError(
            "backend", enum_or_member, "a backend enum member (AttentionBackendEnum, ...)"
        )
    return family


def families() -> tuple[BackendFamily, ...]:
    """Every family, the primary (attention) first."""
    return tuple(_FAMILIES.values())


def on_member_added(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(member)`` (under the registry lock) for every runtime member added,
    before the member is in the enum's tables (so that a thread finding the name there finds
    what the listeners made for it too); if a listener raises, the member is not added and
    the removal listeners are called for it.

    Returns:
        A function that unsubscribes ``listener`` (a no-op once done).
    """
    _new_listeners.append(listener)
    return lambda: _discard(_new_listeners, listener)


def on_member_removed(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(member)`` (under the registry lock) for every runtime member removed.

    Returns:
        A function that unsubscribes ``listener`` (a no-op once done).
    """
    _removed_listeners.append(listener)
    return lambda: _discard(_removed_listeners, listener)


class Subscriptions:
    """The listeners of :func:`on_member_added` and :func:`on_member_removed` and the aliases of
    :func:`register_enum_alias`, as they are when made; :meth:`restore` puts them back as they
    were (a failed plugin's rollback: what it subscribed or aliased goes, what it dropped
    comes back)."""

    def __init__(self) -> None:
        with REGISTRY_LOCK:
            self.added = tuple(_new_listeners)
            self.removed = tuple(_removed_listeners)
            self.aliases = dict(_ALIASES)

    def restore(self) -> None:
        """Put the listeners and aliases back as they were when this was made."""
        with REGISTRY_LOCK:
            _new_listeners[:] = self.added
            _removed_listeners[:] = self.removed
            for foreign_enum in [key for key in _ALIASES if key not in self.aliases]:
                del _ALIASES[foreign_enum]
            _ALIASES.update(self.aliases)


def register_enum_alias(foreign_enum: type[Enum], native_enum: type[BackendEnum]) -> None:
    """Accept the members of ``foreign_enum`` wherever attn_di takes a member of ``native_enum``.

    Another project's enum of the same backends (vLLM's ``AttentionBackendEnum``) then works
    as a key: ``container.backend(vllm_member)``, ``override(vllm_member, impl)``,
    ``register_backend(vllm_member, path)``, ``parse_backend_name``, ``select_backend``.
    A foreign member stands for the native member of the same name; a name the native enum
    lacks becomes a runtime member of it (valued by the foreign member's value, a dotted
    class path) the first time the foreign member is used. That value is the other
    project's default, not a registration: such a member is exported
    (``export_registrations``, ``ATTN_DI_REGISTRATIONS``) only while it has one. Registering
    the same foreign enum again replaces its native enum.

    Args:
        foreign_enum: an :class:`enum.Enum` subclass whose member names are backend names.
        native_enum: :class:`~attn_di.AttentionBackendEnum` or
            :class:`~attn_di.MambaAttentionBackendEnum` (any attn_di backend enum).

    Raises:
        InvalidBackendTypeError: ``foreign_enum`` is not an Enum class, is an attn_di
            enum, or ``native_enum`` is not an attn_di backend enum.
    """
    if not isinstance(foreign_enum, type) or not issubclass(foreign_enum, Enum):
        raise InvalidBackendTypeError("foreign_enum", foreign_enum, "an Enum class")
    if foreign_enum in _FAMILIES:
        raise InvalidBackendTypeError(
            "foreign_enum", foreign_enum, "another project's enum, not an attn_di enum"
        )
    family = _FAMILIES.get(native_enum) if isinstance(native_enum, type) else None
    if family is None:
        raise InvalidBackendTypeError(
            "native_enum", native_enum, "an attn_di backend enum (AttentionBackendEnum, ...)"
        )
    with REGISTRY_LOCK:
        _ALIASES[foreign_enum] = family


def unregister_enum_alias(foreign_enum: type[Enum]) -> None:
    """Stop accepting ``foreign_enum``'s members (no-op if it was not registered).

    Runtime members created for its names stay (remove them like any runtime member)."""
    with REGISTRY_LOCK:
        _ALIASES.pop(foreign_enum, None)


def native_member(key: Any) -> Any:
    """``key`` itself, or for a member of an enum registered with :func:`register_enum_alias`,
    the native member of the same name (created as a runtime member on first use).

    Raises:
        BackendNotRegisteredError: the native enum lacks the name and the foreign member has
            no class path to create it with (a placeholder such as CUSTOM).
        InvalidBackendNameError, InvalidClassPathError: the name or path cannot make a member.
    """
    family = _ALIASES.get(type(key))
    if family is None:
        return key
    name = key.name
    member = family.enum._member_map_.get(name)
    if member is not None:
        return member
    value = key.value
    if not isinstance(value, str) or not value:
        raise BackendNotRegisteredError(name, family.enum.__name__)
    with REGISTRY_LOCK:
        member = family.enum._member_map_.get(name)
        if member is None:
            member = family.add_member(name, value, alias=True)
    return member


def is_alias_member(member: object) -> bool:
    """Whether ``member`` is a runtime member :func:`native_member` created for another
    project's member (:func:`register_enum_alias`), valued by that member's default path.

    Such a member's default is the other project's, which its enum gives every process (the
    alias creates the member there on first use too): containers export it only while it
    has a registration, so using it (an override block, a lookup) never writes
    ``ATTN_DI_REGISTRATIONS``."""
    return bool(getattr(member, "_alias_of_foreign_", False))


def _discard(listeners: list[Callable[[Any], None]], listener: Callable[[Any], None]) -> None:
    with REGISTRY_LOCK:
        if listener in listeners:
            listeners.remove(listener)


def _member_by_name(enum: type[BackendEnum], name: str) -> BackendEnum:
    return family_of(enum).lookup(name)  # type: ignore[no-any-return]
