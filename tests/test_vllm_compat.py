"""vLLM's registry API as published plugins and vLLM's own registry tests use it.

The behaviour reproduced here is vLLM 0.33's (``vllm/v1/attention/backends/registry.py``):
the call shapes of ``register_backend``, runtime members and their rules, error phrases, and
members removed by hand the way vLLM's tests clean up.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    InvalidBackendNameError,
    MambaAttentionBackendEnum,
    UnknownBackendError,
    register_backend,
)
from attn_di.exceptions import BackendNotRegisteredError

E = AttentionBackendEnum
M = MambaAttentionBackendEnum


class PluginBackend:
    """A module-level stand-in for a plugin's backend class."""


PLUGIN_PATH = f"{__name__}.PluginBackend"


def _remove_by_hand(
    enum: type[AttentionBackendEnum | MambaAttentionBackendEnum], name: str
) -> None:
    """Remove a runtime member the way vLLM's tests do (there is no public unregister)."""
    enum._member_map_.pop(name, None)
    if name in enum._member_names_:
        enum._member_names_.remove(name)
    if name in vars(enum):
        delattr(enum, name)


@pytest.fixture(name="hand_removed")
def _hand_removed() -> Iterator[list[tuple[type, str]]]:
    """Names to remove by hand, vLLM style, after the test (before attn_di's own cleanup)."""
    names: list[tuple[type, str]] = []
    yield names
    for enum, name in names:
        _remove_by_hand(enum, name)


# -- 1. register_backend's call shapes -------------------------------------------------------
def test_keyword_call_shape(container: BackendContainer) -> None:
    """register_backend(backend=..., class_path=..., is_mamba=False) registers the path."""
    register_backend(backend=E.TRITON_ATTN, class_path=PLUGIN_PATH, is_mamba=False)
    assert E.TRITON_ATTN.get_path() == PLUGIN_PATH
    assert container.backend(E.TRITON_ATTN) is PluginBackend


def test_positional_none_then_class(container: BackendContainer) -> None:
    """register_backend(E.CUSTOM, None, is_mamba=False)(Cls) registers and returns the class."""
    returned = register_backend(E.CUSTOM, None, is_mamba=False)(PluginBackend)
    assert returned is PluginBackend
    assert container.backend(E.CUSTOM) is PluginBackend


def test_decorator_shape(container: BackendContainer) -> None:
    """@register_backend(E.FLASH_ATTN) registers the decorated class."""

    @register_backend(E.FLASH_ATTN)
    class Decorated:
        pass

    assert container.backend(E.FLASH_ATTN) is Decorated
    assert E.FLASH_ATTN.get_path().endswith("Decorated")


def test_direct_call_returns_identity(container: BackendContainer) -> None:
    """A direct call returns an identity function, as vLLM's does (platform class bodies)."""
    identity = register_backend(E.CUSTOM, PLUGIN_PATH)
    assert identity(PluginBackend) is PluginBackend
    assert container.backend(E.CUSTOM) is PluginBackend


def test_mamba_member_keyword_shape(container: BackendContainer) -> None:
    """register_backend(backend=M.MAMBA2, class_path=..., is_mamba=True) acts on the Mamba enum."""
    register_backend(backend=M.MAMBA2, class_path=PLUGIN_PATH, is_mamba=True)
    assert M.MAMBA2.is_overridden()
    assert container.backend(M.MAMBA2) is PluginBackend
    assert not E.CUSTOM.is_overridden()


def test_container_stays_keyword_only(container: BackendContainer) -> None:
    """container= is attn_di's extra keyword; it reaches the given container only."""
    other = BackendContainer()
    register_backend(E.CUSTOM, PLUGIN_PATH, False, container=other)
    assert other.backend(E.CUSTOM) is PluginBackend
    assert not container.is_overridden(E.CUSTOM)


def test_a_provider_is_accepted(container: BackendContainer) -> None:
    """register_backend(BackendContainer.CUSTOM, ...) and container.register(provider, ...) work."""
    register_backend(BackendContainer.CUSTOM, PLUGIN_PATH)
    assert container.backend(E.CUSTOM) is PluginBackend
    container.register(container.mamba.CUSTOM, "collections.OrderedDict")
    assert container.backend(M.CUSTOM) is collections.OrderedDict


# -- 3. runtime members, vLLM >= 0.32 -----------------------------------------------------------
def test_string_registration_records_the_registration(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """A new name creates the member valued by the path and is_overridden() is True."""
    name = new_name()
    register_backend(name, PLUGIN_PATH)
    member = E[name]
    assert member.value == PLUGIN_PATH
    assert member.is_overridden()
    assert member.get_class() is PluginBackend
    member.clear_override()
    assert not member.is_overridden()
    assert member.get_path() == PLUGIN_PATH


def test_string_registration_as_decorator(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """@register_backend("NEW") creates the member for the class and records it."""
    name = new_name()

    @register_backend(name)
    class Local:
        pass

    assert E[name].is_overridden()
    assert container.backend(name) is Local
    E[name].clear_override()
    assert container.backend(name) is Local  # the member's value is the class itself


def test_enum_register_creates_a_plain_member(new_name: Callable[[], str]) -> None:
    """Enum.register(name, value): the value is the default, nothing is registered."""
    member = E.register(new_name(), PLUGIN_PATH)
    assert not member.is_overridden()
    assert member.get_class() is PluginBackend


def test_lower_case_names_are_accepted(hand_removed: list[tuple[type, str]]) -> None:
    """vLLM accepts "my_backend": any identifier that shadows nothing."""
    hand_removed.append((E, "my_backend"))
    member = E.register("my_backend", PLUGIN_PATH)
    assert E["my_backend"] is member
    assert member.get_class() is PluginBackend


@pytest.mark.parametrize(
    "name", ["register", "get_class", "name", "value", "backend", "mamba", "wire", "1x", "a-b", ""]
)
def test_reserved_and_invalid_names_use_vllms_phrase(name: str) -> None:
    """Attributes of the enum or a container, and non-identifiers: "Invalid or reserved"."""
    before = list(E)
    with pytest.raises(InvalidBackendNameError, match="Invalid or reserved backend name"):
        E.register(name, PLUGIN_PATH)
    assert list(E) == before


def test_duplicate_names_use_vllms_phrase() -> None:
    """An existing name: "already exists", in either enum."""
    with pytest.raises(ValueError, match="already exists in AttentionBackendEnum"):
        E.register("FLASH_ATTN", PLUGIN_PATH)
    with pytest.raises(ValueError, match="already exists in MambaAttentionBackendEnum"):
        M.register("MAMBA1", PLUGIN_PATH)


def test_unknown_name_uses_vllms_phrase() -> None:
    """Enum["X"]: "Unknown attention backend: 'X'. Valid options are: ..." then a suggestion."""
    with pytest.raises(
        ValueError,
        match=r"Unknown attention backend: 'FLASH_ATN'\. Valid options are: FLASH_ATTN, ",
    ) as caught:
        E["FLASH_ATN"]
    assert isinstance(caught.value, UnknownBackendError)
    assert "did you mean 'FLASH_ATTN'?" in str(caught.value)


def test_unregistered_custom_uses_vllms_phrase() -> None:
    """CUSTOM before registration: "must be registered before use", for both enums."""
    for member in (E.CUSTOM, M.CUSTOM):
        with pytest.raises(BackendNotRegisteredError, match="CUSTOM must be registered before use"):
            member.get_class()


def test_custom_is_never_an_alias() -> None:
    """CUSTOM is a member of its own in both enums (value None), listed and iterated."""
    for enum in (E, M):
        assert enum.CUSTOM.value is None
        assert enum.CUSTOM in list(enum)
        assert enum["CUSTOM"] is enum.CUSTOM
    register_backend(E.CUSTOM, PLUGIN_PATH)
    assert not E.TORCH_SDPA.is_overridden()
    assert not M.CUSTOM.is_overridden()


def test_members_removed_by_hand_can_be_registered_again(
    hand_removed: list[tuple[type, str]], container: BackendContainer
) -> None:
    """vLLM's tests pop runtime members by hand; a later register of the name works."""
    hand_removed.append((E, "HAND_REMOVED"))
    first = E.register("HAND_REMOVED", "collections.OrderedDict")
    assert container.backend(first) is collections.OrderedDict
    _remove_by_hand(E, "HAND_REMOVED")
    with pytest.raises(UnknownBackendError):
        E["HAND_REMOVED"]
    second = E.register("HAND_REMOVED", PLUGIN_PATH)
    assert second is not first
    assert container.backend("HAND_REMOVED") is PluginBackend
    assert second.get_class() is PluginBackend
    assert "HAND_REMOVED" in container.export_registrations()


# -- 2. the Mamba enum ------------------------------------------------------------------------
def test_mamba_string_registration(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """register_backend("NEW", path, is_mamba=True) creates a Mamba member, not an attention one."""
    name = new_name()
    register_backend(name, PLUGIN_PATH, is_mamba=True)
    assert M[name].is_overridden()
    assert container.backend(M[name]) is PluginBackend
    assert name not in E.__members__


def test_the_enums_never_see_each_others_names(new_name: Callable[[], str]) -> None:
    """The same new name may exist in both enums; registrations stay apart."""
    name = new_name()
    attention = E.register(name, "collections.OrderedDict")
    mamba = M.register(name, PLUGIN_PATH)
    assert attention.get_class() is collections.OrderedDict
    assert mamba.get_class() is PluginBackend
    with pytest.raises(UnknownBackendError):
        M["FLASH_ATTN"]
    with pytest.raises(UnknownBackendError):
        E["MAMBA2"]


def test_mamba_default_paths() -> None:
    """The Mamba members default to vLLM 0.33's classes."""
    prefix = "vllm.v1.attention.backends."
    assert {m.name: m.value for m in M} == {
        "MAMBA1": prefix + "mamba1_attn.Mamba1AttentionBackend",
        "MAMBA2": prefix + "mamba2_attn.Mamba2AttentionBackend",
        "SHORT_CONV": prefix + "short_conv_attn.ShortConvAttentionBackend",
        "LINEAR": prefix + "linear_attn.LinearAttentionBackend",
        "GDN_ATTN": prefix + "gdn_attn.GDNAttentionBackend",
        "CUSTOM": None,
    }
