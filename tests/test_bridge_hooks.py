"""The core's public hooks for bridges to other projects' registries (vLLM's, in
attn_di.integrations.vllm): enum aliases, member listeners, the registry version, removing
runtime members, reading a registration, and vLLM 0.32's validate_configuration flags."""

from __future__ import annotations

import enum
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

import attn_di
from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    BackendNotRegisteredError,
    InvalidBackendNameError,
    InvalidBackendTypeError,
    MambaAttentionBackendEnum,
)
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend


class ForeignEnum(enum.Enum):
    """Another project's enum of the same backends (as vLLM's is)."""

    CPU_ATTN = "their_pkg.cpu.CPUBackend"
    CUSTOM = None
    FOREIGN_ONLY = "attn_di.backends.torch_sdpa.TorchSDPABackend"
    NO_PATH = ""


class ForeignMamba(enum.Enum):
    MAMBA2 = "their_pkg.mamba2.Backend"


@pytest.fixture(name="aliased")
def _aliased() -> Any:
    """ForeignEnum and ForeignMamba accepted as attn_di keys for one test."""
    attn_di.register_enum_alias(ForeignEnum, AttentionBackendEnum)
    attn_di.register_enum_alias(ForeignMamba, MambaAttentionBackendEnum)
    yield
    attn_di.unregister_enum_alias(ForeignEnum)
    attn_di.unregister_enum_alias(ForeignMamba)


@pytest.mark.usefixtures("aliased")
def test_foreign_members_work_wherever_attn_di_takes_a_member(container: BackendContainer) -> None:
    """backend(), override(), register_backend(), parse_backend_name() take a foreign member
    and act on attn_di's member of the same name (each side keeps its default)."""
    assert container.backend(ForeignEnum.CPU_ATTN) is CPUAttentionBackend
    with container.override(ForeignEnum.CPU_ATTN, TorchSDPABackend):
        assert container.backend(AttentionBackendEnum.CPU_ATTN) is TorchSDPABackend
    attn_di.register_backend(ForeignEnum.CUSTOM, TorchSDPABackend)
    assert container.backend(AttentionBackendEnum.CUSTOM) is TorchSDPABackend
    assert attn_di.parse_backend_name(ForeignEnum.CPU_ATTN) is AttentionBackendEnum.CPU_ATTN
    mamba2 = container.provider(MambaAttentionBackendEnum.MAMBA2)
    assert container.provider(ForeignMamba.MAMBA2) is mamba2


@pytest.mark.usefixtures("aliased")
def test_a_name_attn_di_lacks_becomes_a_runtime_member_on_first_use(
    container: BackendContainer,
) -> None:
    """FOREIGN_ONLY is created (valued by the foreign path) the first time it is used; a
    foreign member without a path cannot create one."""
    assert "FOREIGN_ONLY" not in AttentionBackendEnum.__members__
    assert container.backend(ForeignEnum.FOREIGN_ONLY) is TorchSDPABackend
    member = AttentionBackendEnum.FOREIGN_ONLY
    assert member.is_runtime
    assert member.default_path == ForeignEnum.FOREIGN_ONLY.value
    assert not AttentionBackendEnum.CPU_ATTN.is_runtime
    with pytest.raises(BackendNotRegisteredError, match="NO_PATH"):
        container.backend(ForeignEnum.NO_PATH)


@pytest.mark.usefixtures("aliased")
def test_a_member_made_for_a_foreign_name_is_exported_only_while_registered(
    container: BackendContainer, new_name: Callable[[], str]
) -> None:
    """FOREIGN_ONLY's value is the other project's default, not a registration: using the
    foreign member (a lookup, an override block) or clearing its registration leaves nothing
    in export_registrations() or ATTN_DI_REGISTRATIONS; attn_di's own runtime members are
    exported with their value, as before."""
    attn_di.set_auto_propagation(True)
    path = "attn_di.backends.cpu_attn.CPUAttentionBackend"
    assert container.backend(ForeignEnum.FOREIGN_ONLY) is TorchSDPABackend
    with container.override(ForeignEnum.FOREIGN_ONLY, CPUAttentionBackend):
        assert container.export_registrations() == {}
    assert container.export_registrations() == {}
    assert "ATTN_DI_REGISTRATIONS" not in os.environ
    attn_di.register_backend(ForeignEnum.FOREIGN_ONLY, path)
    assert container.export_registrations() == {"FOREIGN_ONLY": path}
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {"FOREIGN_ONLY": path}
    AttentionBackendEnum.FOREIGN_ONLY.clear_override()
    assert container.export_registrations() == {}
    assert "ATTN_DI_REGISTRATIONS" not in os.environ
    own = new_name()
    attn_di.register_backend(own, path)
    AttentionBackendEnum[own].clear_override()
    assert container.export_registrations() == {own: path}


def test_unaliased_foreign_members_are_refused(container: BackendContainer) -> None:
    """Without register_enum_alias a foreign member is the wrong type, as before."""
    with pytest.raises(InvalidBackendTypeError):
        container.backend(ForeignEnum.CPU_ATTN)


def test_register_enum_alias_refuses_what_is_not_an_enum_pair() -> None:
    """Only another project's Enum class, mapped to an attn_di backend enum."""
    with pytest.raises(InvalidBackendTypeError, match="foreign_enum"):
        attn_di.register_enum_alias(AttentionBackendEnum, MambaAttentionBackendEnum)
    with pytest.raises(InvalidBackendTypeError, match="foreign_enum"):
        attn_di.register_enum_alias(dict, AttentionBackendEnum)  # type: ignore[arg-type]
    with pytest.raises(InvalidBackendTypeError, match="native_enum"):
        attn_di.register_enum_alias(ForeignEnum, ForeignMamba)  # type: ignore[arg-type]


def test_member_listeners_see_runtime_members_come_and_go(new_name: Callable[[], str]) -> None:
    """on_member_added / on_member_removed call back with the member; unsubscribing works."""
    added: list[Any] = []
    removed: list[Any] = []
    stop_added = attn_di.on_member_added(added.append)
    stop_removed = attn_di.on_member_removed(removed.append)
    name = new_name()
    member = AttentionBackendEnum.register(name, "pkg.mod.Backend")
    attn_di.remove_runtime_member(member)
    stop_added()
    stop_removed()
    stop_added()  # a second call is a no-op
    AttentionBackendEnum.register(new_name(), "pkg.mod.Backend")
    assert added == [member]
    assert removed == [member]


def test_remove_runtime_member_frees_the_name(new_name: Callable[[], str]) -> None:
    """A removed runtime member's name can be registered again; built-ins stay."""
    name = new_name()
    attn_di.remove_runtime_member(AttentionBackendEnum.register(name, "pkg.mod.A"))
    assert name not in AttentionBackendEnum.__members__
    assert AttentionBackendEnum.register(name, "pkg.mod.B").default_path == "pkg.mod.B"
    with pytest.raises(InvalidBackendNameError, match="built-in"):
        attn_di.remove_runtime_member(AttentionBackendEnum.CPU_ATTN)


def test_registry_version_changes_with_what_resolution_depends_on(
    container: BackendContainer,
) -> None:
    """Registrations, override blocks (global and local), and use_container change it;
    equal tokens mean nothing changed."""
    start = attn_di.registry_version()
    assert attn_di.registry_version() == start
    attn_di.register_backend(AttentionBackendEnum.CUSTOM, TorchSDPABackend)
    registered = attn_di.registry_version()
    assert registered != start
    with container.override(AttentionBackendEnum.CPU_ATTN, TorchSDPABackend):
        assert attn_di.registry_version() != registered
    after = attn_di.registry_version()
    with container.override(AttentionBackendEnum.CPU_ATTN, TorchSDPABackend, local=True):
        local = attn_di.registry_version()
        assert local != after
        seen: list[object] = []
        thread = threading.Thread(target=lambda: seen.append(attn_di.registry_version()))
        thread.start()
        thread.join()
        assert seen[0] != local  # another thread does not see the local layer
    with attn_di.use_container():
        assert attn_di.registry_version()[0] != after[0]


def test_registration_reads_only_registrations(container: BackendContainer) -> None:
    """container.registration(member): the registered path, not override blocks."""
    assert container.registration(AttentionBackendEnum.CUSTOM) is None
    attn_di.register_backend(AttentionBackendEnum.CUSTOM, "pkg.mod.Backend")
    assert container.registration("CUSTOM") == "pkg.mod.Backend"
    attn_di.register_backend(MambaAttentionBackendEnum.CUSTOM, TorchSDPABackend)
    assert container.registration(MambaAttentionBackendEnum.CUSTOM) == (
        "attn_di.backends.torch_sdpa.TorchSDPABackend"
    )
    with container.override(AttentionBackendEnum.CPU_ATTN, TorchSDPABackend):
        assert container.registration(AttentionBackendEnum.CPU_ATTN) is None
    AttentionBackendEnum.CUSTOM.clear_override()
    assert container.registration(AttentionBackendEnum.CUSTOM) is None


VLLM_032_FLAGS = {
    "use_mm_prefix": "partial multimodal token full attention not supported",
    "use_per_head_quant_scales": "per-head quant scales not supported",
    "use_non_causal": "non-causal attention not supported",
    "use_batch_invariant": "batch invariance not supported",
    "use_pcp": "PCP not supported",
    "use_dcp": "DCP not supported",
    "use_rswa": "R-SWA not supported",
}


@pytest.mark.parametrize(("flag", "reason"), VLLM_032_FLAGS.items())
def test_validate_configuration_takes_vllm_032s_flags(flag: str, reason: str) -> None:
    """Each of vLLM 0.32's flags, set, adds vLLM's reason; unset, nothing."""
    config: dict[str, Any] = dict(
        head_size=64, dtype="float32", kv_cache_dtype="auto", block_size=16, use_mla=False,
        has_sink=False, use_sparse=False, device_capability=None, attn_type="decoder",
    )  # fmt: skip
    assert CPUAttentionBackend.validate_configuration(**config, **{flag: False}) == []
    assert CPUAttentionBackend.validate_configuration(**config, **{flag: True}) == [reason]


def test_sliding_windows_kv_connectors_and_adaptive_verification_are_supported() -> None:
    """attn_di's backends run sliding windows (their impls do), KV connectors and adaptive
    verification; a backend whose impl has no window says so in vLLM's words."""
    config: dict[str, Any] = dict(
        head_size=64, dtype="float32", kv_cache_dtype="auto", block_size=16, use_mla=False,
        has_sink=False, use_sparse=False, device_capability=None,
        has_sliding_window=True, use_kv_connector=True, use_adaptive_verification=True,
    )  # fmt: skip
    assert CPUAttentionBackend.validate_configuration(**config) == []
    assert CPUAttentionBackend.supports_sliding_window()

    class NoWindow(attn_di.backend.AttentionBackend):
        supported_dtypes = ("float32",)

    assert NoWindow.validate_configuration(**config) == ["sliding window not supported"]
