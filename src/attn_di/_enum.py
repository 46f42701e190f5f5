"""``AttentionBackendEnum``: one member per attention backend, valued by its default class path.

The members and default paths follow vLLM 0.11 (``vllm/attention/backends/registry.py``),
except that CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION and NO_ATTENTION default to attn_di's own
reference backends, and CUSTOM (no default) can never alias another member. Members can be
added at runtime with :meth:`AttentionBackendEnum.register`, as in vLLM >= 0.32.

The registry methods (``get_path``, ``get_class``, ...) act on the default container,
:func:`attn_di.get_container`.
"""

from __future__ import annotations

import keyword
import re
import threading
from enum import Enum, EnumMeta
from typing import TYPE_CHECKING, Any

from attn_di._paths import check_class_path
from attn_di.exceptions import InvalidBackendNameError, InvalidBackendTypeError, UnknownBackendError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "AttentionBackendEnum",
    "add_runtime_member",
    "check_new_name",
    "lookup_member",
    "on_new_member",
    "on_removed_member",
    "parse_backend_name",
    "remove_runtime_member",
    "runtime_members",
]

_VLLM = "vllm.v1.attention.backends."
_UPPER_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
_OURS = "attn_di.backends."
_runtime_lock = threading.Lock()
_runtime_listeners: list[Callable[[AttentionBackendEnum], None]] = []
_removal_listeners: list[Callable[[AttentionBackendEnum], None]] = []


class _BackendEnumMeta(EnumMeta):
    """EnumMeta whose ``Enum["X"]`` raises :class:`UnknownBackendError` (a ValueError)."""

    def __getitem__(cls, name: str) -> Any:
        try:
            return cls._member_map_[name]
        except (KeyError, TypeError):
            raise UnknownBackendError(name, list(cls._member_map_)) from None


class AttentionBackendEnum(Enum, metaclass=_BackendEnumMeta):
    """Attention backends by name; each value is the member's default dotted class path.

    ``AttentionBackendEnum["NAME"]`` raises :class:`~attn_di.exceptions.UnknownBackendError`
    (a ``ValueError``) listing the valid names and suggesting the closest one.
    """

    FLASH_ATTN = _VLLM + "flash_attn.FlashAttentionBackend"
    FLASH_SINK_ATTN = _VLLM + "flash_sink_attn.FlashSinkAttentionBackend"
    TRITON_ATTN = _VLLM + "triton_attn.TritonAttentionBackend"
    XFORMERS = _VLLM + "xformers.XFormersAttentionBackend"
    ROCM_ATTN = _VLLM + "rocm_attn.RocmAttentionBackend"
    ROCM_AITER_MLA = _VLLM + "mla.rocm_aiter_mla.AiterMLABackend"
    ROCM_AITER_FA = _VLLM + "rocm_aiter_fa.AiterFlashAttentionBackend"
    TORCH_SDPA = _OURS + "torch_sdpa.TorchSDPABackend"
    FLASHINFER = _VLLM + "flashinfer.FlashInferBackend"
    FLASHINFER_MLA = _VLLM + "mla.flashinfer_mla.FlashInferMLABackend"
    TRITON_MLA = _VLLM + "mla.triton_mla.TritonMLABackend"
    CUTLASS_MLA = _VLLM + "mla.cutlass_mla.CutlassMLABackend"
    FLASHMLA = _VLLM + "mla.flashmla.FlashMLABackend"
    FLASHMLA_SPARSE = _VLLM + "mla.flashmla_sparse.FlashMLASparseBackend"
    FLASH_ATTN_MLA = _VLLM + "mla.flashattn_mla.FlashAttnMLABackend"
    PALLAS = _VLLM + "pallas.PallasAttentionBackend"
    IPEX = _VLLM + "ipex.IpexAttentionBackend"
    NO_ATTENTION = _OURS + "no_attention.NoAttentionBackend"
    FLEX_ATTENTION = _OURS + "flex_attention.FlexAttentionBackend"
    TREE_ATTN = _VLLM + "tree_attn.TreeAttentionBackend"
    ROCM_AITER_UNIFIED_ATTN = _VLLM + "rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend"
    CPU_ATTN = _OURS + "cpu_attn.CPUAttentionBackend"
    CUSTOM = ""  # no default: register one. Unique value, so never an alias.

    # Members are singletons: identity hashing is correct and C-fast (Enum's is Python code).
    __hash__ = object.__hash__

    def __reduce_ex__(
        self, protocol: object
    ) -> tuple[Callable[[str], AttentionBackendEnum], tuple[str]]:
        # By name, not by value: runtime members may share a value with another member.
        return lookup_member, (self._name_,)

    @classmethod
    def _missing_(cls, value: object) -> AttentionBackendEnum:
        # AttentionBackendEnum("...") looks members up by default class path.
        raise UnknownBackendError(value, list(cls._member_map_), looked_up="class path")

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
        return _default.get_container().get_path(self, include_classname)

    def get_class(self) -> type[Any]:
        """Import (lazily, once) and return the class this member resolves to.

        Respects context-local overrides, override blocks and registrations, in that order.

        Raises:
            BackendNotRegisteredError: the member has no path (CUSTOM before registration).
            BackendImportError: the path does not import (module or attribute missing, or the
                module failing on import).
        """
        container = _default._default
        if container is not None and not _provider.LOCAL_LAYERS.get():
            try:
                return container._resolved[self]  # the container's warm-path cache
            except KeyError:
                pass
        return _default.get_container().backend(self)

    def is_overridden(self) -> bool:
        """True while a registration or an override (global or local) is active."""
        return _default.get_container().is_overridden(self)

    def clear_override(self) -> None:
        """Forget the registration, returning to the default path. No-op if none.

        Override blocks (``with container.override(...)``) are not touched: they end themselves.
        """
        _default.get_container().clear_override(self)

    @classmethod
    def register(cls, name: str, class_path: str) -> AttentionBackendEnum:
        """Add a member at runtime, whose default class path is ``class_path``.

        Every container, existing or future, gets a provider for it.

        Args:
            name: a Python identifier, not an existing member (compared case-insensitively),
                not an attribute of the enum, and not starting with ``_``.
            class_path: a dotted class path (not imported now).

        Returns:
            The new member.

        Raises:
            InvalidBackendNameError: the name is refused (nothing changes).
            InvalidClassPathError: the path is malformed (nothing changes).
            InvalidBackendTypeError: name or class_path is not a string.
        """
        return add_runtime_member(name, class_path)


def add_runtime_member(
    name: str, class_path: str, default_cls: object = None
) -> AttentionBackendEnum:
    """Add a runtime member (see :meth:`AttentionBackendEnum.register`).

    Args:
        default_cls: the class the path names, when already at hand (a decorated class,
            possibly defined in a function): every container resolves to it without importing.
    """
    if not isinstance(class_path, str):
        raise InvalidBackendTypeError("class_path", class_path, "a dotted path string")
    if default_cls is None:  # a class at hand may live in a function (a ``<locals>`` path)
        check_class_path(class_path)
    with _runtime_lock:
        check_new_name(name)
        member = _add_member(name, class_path)
        if default_cls is not None:
            member._default_cls_ = default_cls  # type: ignore[attr-defined]
        for listener in _runtime_listeners:
            listener(member)
    return member


def lookup_member(key: object) -> AttentionBackendEnum:
    """The member for a member or its exact name.

    Raises:
        UnknownBackendError: anything else (a ValueError), with the closest name.
    """
    if isinstance(key, AttentionBackendEnum):
        return key
    return AttentionBackendEnum[key]  # type: ignore[misc]


def parse_backend_name(name: object) -> AttentionBackendEnum | None:
    """Parse a backend name as typed by a user (env var, CLI, config file).

    Case-insensitive, surrounding spaces ignored, inner spaces and hyphens read as ``_``;
    ``None``, ``""`` and ``"auto"`` mean automatic selection and give None. A member is returned
    as is.

    Raises:
        UnknownBackendError: an unknown name (never ignored), with the closest suggestion.
        InvalidBackendTypeError: neither a string nor a member.
    """
    if name is None or isinstance(name, AttentionBackendEnum):
        return name
    if not isinstance(name, str):
        raise InvalidBackendTypeError("backend", name, "a backend name or an AttentionBackendEnum")
    text = re.sub(r"[\s-]+", "_", name.strip())  # "torch sdpa", "torch-sdpa" -> TORCH_SDPA
    if text.lower() in ("", "auto"):
        return None
    members = AttentionBackendEnum._member_map_
    member = members.get(text) or members.get(text.upper())
    if member is None:
        by_upper = {key.upper(): value for key, value in members.items()}
        member = by_upper.get(text.upper())
    if member is None:
        raise UnknownBackendError(name, [*members, "auto"])
    return member  # type: ignore[return-value]


def check_new_name(name: object) -> str:
    """Validate a runtime member name; raise :class:`InvalidBackendNameError` if refused."""
    if not isinstance(name, str):
        raise InvalidBackendTypeError("name", name, "a member name string")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidBackendNameError(name, "not a valid Python identifier")
    if name.startswith("_"):
        raise InvalidBackendNameError(name, "names starting with '_' are reserved")
    members = AttentionBackendEnum._member_map_
    if name in members:
        raise InvalidBackendNameError(name, "a member with this name exists", existing=name)
    for existing in members:
        if existing.upper() == name.upper():
            raise InvalidBackendNameError(
                name, f"it differs from {existing} only by case", existing=existing
            )
    if not _UPPER_NAME.fullmatch(name):
        # Upper case, like every built-in member: a member name is also an attribute of
        # every container, whose own attributes (backend, providers, wire, ...) are lower case.
        raise InvalidBackendNameError(name, "member names are upper case (A-Z, 0-9, _)")
    namespaces = [*type.mro(AttentionBackendEnum), *type.mro(_BackendEnumMeta)]
    if any(name in vars(namespace) for namespace in namespaces):
        raise InvalidBackendNameError(name, "it would shadow an attribute of AttentionBackendEnum")
    return name


def on_new_member(listener: Callable[[AttentionBackendEnum], None]) -> None:
    """Call ``listener(member)`` for every runtime member added from now on."""
    _runtime_listeners.append(listener)


def on_removed_member(listener: Callable[[AttentionBackendEnum], None]) -> None:
    """Call ``listener(member)`` for every runtime member removed from now on."""
    _removal_listeners.append(listener)


def runtime_members() -> list[AttentionBackendEnum]:
    """The members added at runtime, oldest first."""
    return [m for m in AttentionBackendEnum if m.name not in _BUILTIN_NAMES]


def remove_runtime_member(member: AttentionBackendEnum) -> None:
    """Remove a runtime member and its providers (for test isolation; built-ins are kept).

    Raises:
        InvalidBackendNameError: ``member`` is a built-in member.
    """
    cls = AttentionBackendEnum
    if member.name in _BUILTIN_NAMES:
        raise InvalidBackendNameError(member.name, "built-in members cannot be removed")
    with _runtime_lock:
        if cls._member_map_.get(member.name) is not member:
            return
        del cls._member_map_[member.name]
        cls._member_names_.remove(member.name)
        if cls._value2member_map_.get(member.value) is member:
            del cls._value2member_map_[member.value]
        type.__delattr__(cls, member.name)
        for listener in _removal_listeners:
            listener(member)


def _add_member(name: str, class_path: str) -> AttentionBackendEnum:
    cls = AttentionBackendEnum
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = class_path
    member._sort_order_ = len(cls._member_names_)  # type: ignore[attr-defined]
    add_member = getattr(cls, "_add_member_", None)  # Python >= 3.13
    if add_member is not None:
        add_member(name, member)
    else:
        type.__setattr__(cls, name, member)
        cls._member_map_[name] = member
        cls._member_names_.append(name)
    cls._value2member_map_.setdefault(class_path, member)
    return member


_BUILTIN_NAMES = frozenset(AttentionBackendEnum.__members__)

# Imported last (a cycle): the container declares one provider per member of the enum above.
from attn_di import _default, _provider  # noqa: E402
