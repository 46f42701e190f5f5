"""The public surface of attn_di is pinned."""

from __future__ import annotations

import attn_di


def test_all_is_pinned_and_sorted() -> None:
    """__all__ lists exactly the public names, alphabetically."""
    assert attn_di.__all__ == sorted(attn_di.__all__)
    assert attn_di.__all__ == [
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


def test_every_exported_name_exists() -> None:
    """Each name in __all__ is importable from attn_di."""
    for name in attn_di.__all__:
        assert getattr(attn_di, name) is not None


def test_public_classes_present_themselves_under_the_package() -> None:
    """Exported classes of private modules report ``attn_di`` as their module."""
    for cls in (
        attn_di.AttentionBackendEnum,
        attn_di.BackendContainer,
        attn_di.BackendOverride,
        attn_di.BackendProvider,
        attn_di.MambaAttentionBackendEnum,
        attn_di.MambaBackendContainer,
        attn_di.OverrideBackendFixture,
        attn_di.PluginRecord,
        attn_di.PluginReport,
        attn_di.PropagatedRegistrations,
    ):
        assert cls.__module__ == "attn_di"
