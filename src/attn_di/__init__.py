"""attn_di: attention backends named, registered, selected, injected and tested.

vLLM's ``AttentionBackendEnum`` registry rebuilt on dependency-injector: every member is
a lazy provider in a :class:`BackendContainer`; :func:`register_backend` and
``member.clear_override()`` act on the default container (:func:`get_container`);
``with container.override(member, impl):`` swaps an implementation for one block.

Importing attn_di never imports torch, vLLM or any backend module.
"""

__all__ = [
    "AttentionBackendEnum",
    "AttnDIError",
    "BackendContainer",
    "BackendImportError",
    "BackendNotRegisteredError",
    "BackendOverride",
    "BackendProvider",
    "InvalidBackendNameError",
    "InvalidBackendTypeError",
    "InvalidClassPathError",
    "UnexportableBackendError",
    "UnknownBackendError",
    "get_container",
    "register_backend",
    "use_container",
]

from attn_di._container import BackendContainer
from attn_di._default import get_container, register_backend, use_container
from attn_di._deprecated import DeprecatedBackendAlias
from attn_di._enum import AttentionBackendEnum
from attn_di._overrides import BackendOverride
from attn_di._provider import BackendProvider
from attn_di.exceptions import (
    AttnDIError,
    BackendImportError,
    BackendNotRegisteredError,
    InvalidBackendNameError,
    InvalidBackendTypeError,
    InvalidClassPathError,
    UnexportableBackendError,
    UnknownBackendError,
)

_Backend = DeprecatedBackendAlias
"""Deprecated alias of :class:`AttentionBackendEnum` (vLLM's old name); warns on use."""

for _exported in (AttentionBackendEnum, BackendContainer, BackendOverride, BackendProvider):
    _exported.__module__ = "attn_di"
del _exported
