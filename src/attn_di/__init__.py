"""attn_di: attention backends named, registered, selected, injected and tested.

vLLM's ``AttentionBackendEnum`` and ``MambaAttentionBackendEnum`` registries rebuilt on
dependency-injector, with vLLM's API: every member is a lazy provider in a
:class:`BackendContainer`; :func:`register_backend` and ``member.clear_override()`` act on
the default container (:func:`get_container`); ``with container.override(member, impl):``
swaps an implementation for one block.

Importing attn_di never imports torch, vLLM or any backend module, and never scans entry
points (:func:`load_plugins` does). A process started with ``ATTN_DI_REGISTRATIONS`` set
(automatically by every registration, or by :func:`propagate_registrations` and
:func:`ray_runtime_env`) applies it at import.
"""

__all__ = [
    "AttentionBackendEnum",
    "AttentionSelectorConfig",
    "AttnDIError",
    "BackendContainer",
    "BackendImportError",
    "BackendNotRegisteredError",
    "BackendOverride",
    "BackendProvider",
    "BackendRejectedError",
    "InvalidBackendNameError",
    "InvalidBackendTypeError",
    "InvalidClassPathError",
    "MambaAttentionBackendEnum",
    "MambaBackendContainer",
    "NoValidBackendError",
    "OverrideBackendFixture",
    "PluginRecord",
    "PluginReport",
    "PropagatedRegistrations",
    "RegistrationsEnvError",
    "Selection",
    "UnexportableBackendError",
    "UnknownBackendError",
    "force_backend",
    "get_container",
    "load_plugins",
    "on_member_added",
    "on_member_removed",
    "parse_backend_name",
    "plugin_report",
    "propagate_registrations",
    "ray_runtime_env",
    "register_backend",
    "register_enum_alias",
    "registry_version",
    "remove_runtime_member",
    "select_backend",
    "set_auto_propagation",
    "unregister_enum_alias",
    "use_container",
]

import os as _os
from typing import TYPE_CHECKING, Any

from attn_di._container import BackendContainer, MambaBackendContainer
from attn_di._default import get_container, register_backend, registry_version, use_container
from attn_di._deprecated import DeprecatedBackendAlias
from attn_di._enum import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    parse_backend_name,
    remove_runtime_member,
)
from attn_di._family import (
    on_member_added,
    on_member_removed,
    register_enum_alias,
    unregister_enum_alias,
)
from attn_di._overrides import BackendOverride
from attn_di._propagation import (
    apply_inherited_registrations as _apply_inherited_registrations,
)
from attn_di._propagation import read_auto_switch as _read_auto_switch
from attn_di._propagation import set_auto_propagation
from attn_di._provider import BackendProvider
from attn_di.exceptions import (
    AttnDIError,
    BackendImportError,
    BackendNotRegisteredError,
    BackendRejectedError,
    InvalidBackendNameError,
    InvalidBackendTypeError,
    InvalidClassPathError,
    NoValidBackendError,
    RegistrationsEnvError,
    UnexportableBackendError,
    UnknownBackendError,
)
from attn_di.exceptions import EnvSwitchError as _EnvSwitchError

if TYPE_CHECKING:
    from attn_di._plugins import PluginRecord, PluginReport, load_plugins, plugin_report
    from attn_di._propagation import (
        PropagatedRegistrations,
        propagate_registrations,
        ray_runtime_env,
    )
    from attn_di._selection import AttentionSelectorConfig, Selection, force_backend, select_backend
    from attn_di._testing import OverrideBackendFixture

# Imported on first use (PEP 562), so that `import attn_di` stays light.
_LAZY = {
    "AttentionSelectorConfig": "attn_di._selection",
    "Selection": "attn_di._selection",
    "force_backend": "attn_di._selection",
    "select_backend": "attn_di._selection",
    "PluginRecord": "attn_di._plugins",
    "PluginReport": "attn_di._plugins",
    "load_plugins": "attn_di._plugins",
    "plugin_report": "attn_di._plugins",
    "PropagatedRegistrations": "attn_di._propagation",
    "propagate_registrations": "attn_di._propagation",
    "ray_runtime_env": "attn_di._propagation",
    "OverrideBackendFixture": "attn_di._testing",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'attn_di' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    if isinstance(value, type):
        value.__module__ = "attn_di"
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


_Backend = DeprecatedBackendAlias
"""Deprecated alias of :class:`AttentionBackendEnum` (vLLM's old name); warns on use."""

for _exported in (
    AttentionBackendEnum,
    BackendContainer,
    BackendOverride,
    BackendProvider,
    MambaAttentionBackendEnum,
    MambaBackendContainer,
):
    _exported.__module__ = "attn_di"
del _exported

try:
    _read_auto_switch()  # ATTN_DI_AUTO_PROPAGATE
    if _os.environ.get("ATTN_DI_REGISTRATIONS") is not None:  # a worker: apply the parent's
        _apply_inherited_registrations()
except (RegistrationsEnvError, _EnvSwitchError) as _error:  # attn-di: one line, no traceback
    from attn_di.cli._output import exit_if_command

    exit_if_command(_error, _error.hint)
    raise
