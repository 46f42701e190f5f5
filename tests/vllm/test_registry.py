"""vLLM's registry with the bridge installed: vLLM's own semantics still hold, and both sides
share one registry (registrations, overrides, runtime members; each keeps its defaults).

The first group reproduces the behaviour vLLM's registry tests check (written here, not
copied); the second checks what the bridge adds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

import torch
from pytest_mock import MockerFixture
from vllm.v1.attention.backend import AttentionBackend as VllmAttentionBackend
from vllm.v1.attention.backend import AttentionImpl
from vllm.v1.attention.backends import registry
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as VllmCPUBackend
from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    register_backend,
)
from vllm.v1.attention.selector import AttentionSelectorConfig

import attn_di
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.exceptions import InvalidBackendNameError
from attn_di.integrations import vllm as bridge

HERE = __name__


class CustomImpl(AttentionImpl):  # type: ignore[misc]
    """An impl that is never run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> None:
        pass


class CustomAttentionBackend(VllmAttentionBackend):  # type: ignore[misc]
    """A vLLM backend defined at module level (importable by path)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CustomImpl]:
        return CustomImpl

    @staticmethod
    def get_builder_cls() -> None:
        return None


class CustomMambaBackend(CustomAttentionBackend):  # type: ignore[misc]
    """A Mamba-side twin."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM_MAMBA"


class DecoratedBackend(CustomAttentionBackend):  # type: ignore[misc]
    """Registered by decorator in one test."""

    @staticmethod
    def get_name() -> str:
        return "DECORATED"


ENUMS = [
    pytest.param((AttentionBackendEnum, False, f"{HERE}.CustomAttentionBackend"), id="attention"),
    pytest.param((MambaAttentionBackendEnum, True, f"{HERE}.CustomMambaBackend"), id="mamba"),
]


def _remove_by_hand(enum_cls: Any, member: Any) -> None:
    """What vLLM's tests do to the members they create: pop them from the enum's tables."""
    enum_cls._member_map_.pop(member.name, None)
    enum_cls._member_names_.remove(member.name)
    delattr(enum_cls, member.name)
    if enum_cls._value2member_map_.get(member.value) is member:
        del enum_cls._value2member_map_[member.value]


@pytest.fixture(autouse=True)
def _clean_vllm_registrations() -> Iterator[None]:
    """vLLM's members leave each test as they came (the attn_di fixture resets attn_di)."""
    yield
    for enum_cls in (AttentionBackendEnum, MambaAttentionBackendEnum):
        for member in enum_cls:
            member.clear_override()


# -- vLLM's registry semantics, with the bridge installed ------------------------------------
@pytest.mark.parametrize("enum_cls", [AttentionBackendEnum, MambaAttentionBackendEnum])
def test_custom_is_never_an_alias(enum_cls: Any) -> None:
    """CUSTOM (value None) is its own member in both enums."""
    aliases = [m.name for m in enum_cls if m.name != "CUSTOM" and m is enum_cls.CUSTOM]
    assert aliases == []
    assert enum_cls.CUSTOM.name == "CUSTOM"
    assert "CUSTOM" in [m.name for m in enum_cls]


@pytest.mark.parametrize("case", ENUMS)
def test_register_by_class_path(case: tuple[Any, bool, str]) -> None:
    """register_backend(backend=CUSTOM, class_path=..., is_mamba=...) overrides CUSTOM."""
    enum_cls, is_mamba, path = case
    register_backend(backend=enum_cls.CUSTOM, class_path=path, is_mamba=is_mamba)
    assert enum_cls.CUSTOM.is_overridden()
    assert enum_cls.CUSTOM.get_path() == path
    assert enum_cls.CUSTOM.get_path(include_classname=False) == HERE
    assert enum_cls.CUSTOM.get_class().get_impl_cls() is CustomImpl
    enum_cls.CUSTOM.clear_override()
    assert not enum_cls.CUSTOM.is_overridden()
    with pytest.raises(ValueError, match="Backend CUSTOM must be registered before use"):
        enum_cls.CUSTOM.get_path()


def test_register_by_decorator_returns_the_class() -> None:
    """@register_backend(member) registers module.qualname and returns the class unchanged."""
    result = register_backend(AttentionBackendEnum.FLASH_ATTN)(DecoratedBackend)
    assert result is DecoratedBackend
    assert AttentionBackendEnum.FLASH_ATTN.get_path() == f"{HERE}.DecoratedBackend"
    assert AttentionBackendEnum.FLASH_ATTN.get_class() is DecoratedBackend


@pytest.mark.parametrize("case", ENUMS)
def test_enum_register_creates_a_member_that_survives_removal_by_hand(
    case: tuple[Any, bool, str],
) -> None:
    """Enum.register(name, path) makes a member valued by the path; removed by hand (as
    vLLM's tests do), the name can be registered again."""
    enum_cls, _, path = case
    for _ in range(2):
        member = enum_cls.register("DYNAMIC_TEST", path)
        assert (member.name, member.value) == ("DYNAMIC_TEST", path)
        assert member is enum_cls.DYNAMIC_TEST is enum_cls["DYNAMIC_TEST"]
        assert not member.is_overridden()
        assert member.get_path() == path
        _remove_by_hand(enum_cls, member)
        assert "DYNAMIC_TEST" not in enum_cls.__members__


@pytest.mark.parametrize("case", ENUMS)
def test_duplicate_and_reserved_names_are_refused_in_vllms_words(
    case: tuple[Any, bool, str],
) -> None:
    """A second register of a name, or a reserved one, raises vLLM's ValueError phrases."""
    enum_cls, is_mamba, path = case
    enum_cls.register("DUP_TEST", "some.module.Class")
    with pytest.raises(ValueError, match="already exists"):
        enum_cls.register("DUP_TEST", "other.module.OtherClass")
    with pytest.raises(ValueError, match="already exists"):
        register_backend("DUP_TEST", path, is_mamba=is_mamba)
    with pytest.raises(ValueError, match="Invalid or reserved backend name"):
        enum_cls.register("get_path", "some.module.Class")
    with pytest.raises(InvalidBackendNameError, match="Invalid or reserved backend name"):
        register_backend("not an identifier", path, is_mamba=is_mamba)
    assert enum_cls.DUP_TEST.value == "some.module.Class"
    _remove_by_hand(enum_cls, enum_cls.DUP_TEST)


@pytest.mark.parametrize("case", ENUMS)
def test_string_name_creates_a_registered_member(case: tuple[Any, bool, str]) -> None:
    """register_backend("NAME", path, is_mamba=...) creates the member and registers the path
    (is_overridden() is True; clear_override() returns to the value)."""
    enum_cls, is_mamba, path = case
    register_backend("STRING_DIRECT", path, is_mamba=is_mamba)
    member = enum_cls.STRING_DIRECT
    assert member.is_overridden()
    assert member.get_path() == path
    assert member.get_class().get_name() == ("CUSTOM_MAMBA" if is_mamba else "CUSTOM")
    member.clear_override()
    assert not member.is_overridden()
    assert member.get_path() == path
    _remove_by_hand(enum_cls, member)


@pytest.mark.parametrize("case", ENUMS)
def test_string_name_decorator(case: tuple[Any, bool, str]) -> None:
    """register_backend("NAME", is_mamba=...)(cls) returns cls; the member resolves to it."""
    enum_cls, is_mamba, _ = case
    assert register_backend("STRING_DECORATOR", is_mamba=is_mamba)(DecoratedBackend) is (
        DecoratedBackend
    )
    member = enum_cls.STRING_DECORATOR
    assert member.is_overridden()
    assert member.get_path() == f"{HERE}.DecoratedBackend"
    assert member.get_class() is DecoratedBackend
    member.clear_override()
    _remove_by_hand(enum_cls, member)


def test_unknown_name_keeps_vllms_error() -> None:
    """AttentionBackendEnum["NOPE"] is vLLM's ValueError listing the valid names."""
    with pytest.raises(ValueError, match=r"Unknown attention backend: 'NOPE'\. Valid options are"):
        AttentionBackendEnum["NOPE"]


def test_validate_configuration_takes_vllms_selector_config() -> None:
    """attn_di's backends answer vLLM 0.32's validate_configuration(**config._asdict()) call,
    with "DCP not supported" when decode context parallelism is asked for."""
    config = AttentionSelectorConfig(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16
    )
    kwargs: dict[str, Any] = dict(device_capability=None, **config._asdict())
    assert CPUAttentionBackend.validate_configuration(**kwargs) == []
    kwargs["use_dcp"] = True
    assert CPUAttentionBackend.validate_configuration(**kwargs) == ["DCP not supported"]


# -- one registry on both sides ---------------------------------------------------------------
def test_registrations_are_seen_by_both_sides() -> None:
    """vLLM's register_backend registers in attn_di's container; attn_di's is seen by vLLM."""
    container = attn_di.get_container()
    register_backend(AttentionBackendEnum.CUSTOM, f"{HERE}.CustomAttentionBackend")
    assert container.registration(attn_di.AttentionBackendEnum.CUSTOM) == (
        f"{HERE}.CustomAttentionBackend"
    )
    assert container.backend(AttentionBackendEnum.CUSTOM) is CustomAttentionBackend
    attn_di.register_backend(attn_di.AttentionBackendEnum.FLASH_ATTN, DecoratedBackend)
    assert AttentionBackendEnum.FLASH_ATTN.is_overridden()
    assert AttentionBackendEnum.FLASH_ATTN.get_class() is DecoratedBackend
    assert dict(registry._ATTN_OVERRIDES) == {
        AttentionBackendEnum.CUSTOM: f"{HERE}.CustomAttentionBackend",
        AttentionBackendEnum.FLASH_ATTN: f"{HERE}.DecoratedBackend",
    }


def test_each_side_keeps_its_defaults() -> None:
    """With nothing registered, vLLM's CPU_ATTN is vLLM's class and attn_di's is attn_di's."""
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is VllmCPUBackend
    assert attn_di.get_container().backend(AttentionBackendEnum.CPU_ATTN) is CPUAttentionBackend


def test_global_override_reaches_vllm_and_ends_exactly() -> None:
    """Inside the block vLLM's get_class/get_path/is_overridden give the override; after it,
    exactly the previous answers, also when the block raised and when blocks end out of order."""
    container = attn_di.get_container()
    register_backend(AttentionBackendEnum.CUSTOM, f"{HERE}.CustomAttentionBackend")
    member = AttentionBackendEnum.CUSTOM
    seen: list[Any] = []

    def inside() -> None:
        with container.override(member, DecoratedBackend):
            seen.extend([member.get_class(), member.get_path()])
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        inside()
    assert seen == [DecoratedBackend, f"{HERE}.DecoratedBackend"]
    assert member.get_class() is CustomAttentionBackend
    first = container.override(member, DecoratedBackend)
    second = container.override(member, CustomMambaBackend)
    first.restore()
    assert member.get_class() is CustomMambaBackend
    second.restore()
    assert member.get_class() is CustomAttentionBackend
    assert member.get_path() == f"{HERE}.CustomAttentionBackend"
    assert member.is_overridden()  # the registration, as before the blocks
    member.clear_override()
    with container.override(AttentionBackendEnum.CPU_ATTN, DecoratedBackend):
        assert AttentionBackendEnum.CPU_ATTN.is_overridden()
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is VllmCPUBackend


def test_local_override_is_seen_only_in_its_thread() -> None:
    """local=True: this thread sees the override, another thread vLLM's default."""
    seen: list[Any] = []
    with attn_di.get_container().override(
        AttentionBackendEnum.CPU_ATTN, DecoratedBackend, local=True
    ):
        assert AttentionBackendEnum.CPU_ATTN.get_class() is DecoratedBackend
        thread = threading.Thread(
            target=lambda: seen.append(AttentionBackendEnum.CPU_ATTN.get_class())
        )
        thread.start()
        thread.join()
    assert seen == [VllmCPUBackend]
    assert AttentionBackendEnum.CPU_ATTN.get_class() is VllmCPUBackend


def test_a_mock_and_a_local_class_work_as_overrides(mocker: MockerFixture) -> None:
    """Objects given to override() come back as they are (never re-imported by path)."""

    class LocalBackend(CustomAttentionBackend):  # type: ignore[misc]
        pass

    fake = mocker.Mock(spec=CustomAttentionBackend)
    container = attn_di.get_container()
    with container.override(AttentionBackendEnum.CUSTOM, LocalBackend):
        assert AttentionBackendEnum.CUSTOM.get_class() is LocalBackend
        assert "<locals>" in AttentionBackendEnum.CUSTOM.get_path()
    with container.override(AttentionBackendEnum.CUSTOM, fake):
        assert AttentionBackendEnum.CUSTOM.get_class() is fake


def test_vllm_only_members_become_runtime_members_when_first_used() -> None:
    """A vLLM member attn_di does not declare maps by name to a runtime member created on
    first use, valued by vLLM's default path; vLLM members work wherever attn_di takes one."""
    assert "TURBOQUANT" not in attn_di.AttentionBackendEnum.__members__
    container = attn_di.get_container()
    assert (
        container.get_path(AttentionBackendEnum.TURBOQUANT) == AttentionBackendEnum.TURBOQUANT.value
    )
    member = attn_di.AttentionBackendEnum.TURBOQUANT
    assert member.is_runtime
    with container.override(AttentionBackendEnum.TURBOQUANT, DecoratedBackend):
        assert AttentionBackendEnum.TURBOQUANT.get_class() is DecoratedBackend
        assert container.backend(member) is DecoratedBackend
    assert not AttentionBackendEnum.TURBOQUANT.is_overridden()
    assert attn_di.parse_backend_name(AttentionBackendEnum.CPU_ATTN) is (
        attn_di.AttentionBackendEnum.CPU_ATTN
    )


def test_a_propagated_registration_of_a_vllm_only_member_is_seen_by_vllm() -> None:
    """In a worker, ATTN_DI_REGISTRATIONS recreates a registered vLLM-only member as an attn_di
    runtime member valued by the registered path: vLLM's member resolves to that path."""
    snapshot = {"TURBOQUANT": f"{HERE}.CustomAttentionBackend"}
    attn_di.get_container().apply_registrations(snapshot)  # what import attn_di does there
    assert AttentionBackendEnum.TURBOQUANT.is_overridden()
    assert AttentionBackendEnum.TURBOQUANT.get_path() == f"{HERE}.CustomAttentionBackend"
    assert AttentionBackendEnum.TURBOQUANT.get_class() is CustomAttentionBackend


def test_attn_di_runtime_members_appear_in_vllms_enum() -> None:
    """attn_di.register_backend("NAME", path) gives vLLM's enum the member too; removing the
    attn_di member (the test fixture does) removes vLLM's."""
    attn_di.register_backend("FROM_ATTN_DI", f"{HERE}.CustomAttentionBackend")
    member = AttentionBackendEnum["FROM_ATTN_DI"]
    assert member.get_class() is CustomAttentionBackend
    assert member.is_overridden()
    attn_di.remove_runtime_member(attn_di.AttentionBackendEnum.FROM_ATTN_DI)
    assert "FROM_ATTN_DI" not in AttentionBackendEnum.__members__


def test_vllms_original_register_backend_writes_attn_di() -> None:
    """Code that bound vLLM's own register_backend before install() still registers in
    attn_di (vLLM's module dict is a view of attn_di's registrations)."""
    original = bridge._bridge._installation.module_attrs["register_backend"]  # type: ignore[union-attr]
    original(AttentionBackendEnum.CUSTOM, f"{HERE}.CustomAttentionBackend")
    assert attn_di.get_container().backend(attn_di.AttentionBackendEnum.CUSTOM) is (
        CustomAttentionBackend
    )
    del registry._ATTN_OVERRIDES[AttentionBackendEnum.CUSTOM]
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_uninstall_leaves_vllm_exactly_as_before() -> None:
    """After uninstall(), vLLM's functions, dicts, methods and member tables are those of
    before install() (a registration made before install() was carried over and is back)."""
    bridge.uninstall()
    try:
        registry.register_backend(AttentionBackendEnum.CUSTOM, f"{HERE}.CustomAttentionBackend")
        before = _vllm_state()
        bridge.install()
        bridge.install()  # idempotent
        assert attn_di.get_container().backend(AttentionBackendEnum.CUSTOM) is (
            CustomAttentionBackend
        )
        register_backend(AttentionBackendEnum.FLASH_ATTN, f"{HERE}.DecoratedBackend")
        register_backend("WHILE_INSTALLED", f"{HERE}.CustomAttentionBackend")
        AttentionBackendEnum.register("ALSO_WHILE_INSTALLED", f"{HERE}.CustomMambaBackend")
        from attn_di.integrations.vllm._failures import patch_engine_client

        patch_engine_client()  # what the start-up check does where an engine starts
        bridge.uninstall()
        assert _vllm_state() == before
        assert {
            AttentionBackendEnum.CUSTOM: f"{HERE}.CustomAttentionBackend"
        } == registry._ATTN_OVERRIDES
        assert attn_di.get_container().registration(attn_di.AttentionBackendEnum.CUSTOM) is None
        registry._ATTN_OVERRIDES.clear()
    finally:
        bridge.install()


def _vllm_state() -> tuple[Any, ...]:
    """Identities and contents of what install() replaces."""
    state: list[Any] = [
        registry.register_backend,
        id(registry._ATTN_OVERRIDES),
        dict(registry._ATTN_OVERRIDES),
        id(registry._MAMBA_ATTN_OVERRIDES),
        dict(registry._MAMBA_ATTN_OVERRIDES),
    ]
    import vllm.v1.attention.selector as selector
    from vllm.engine.arg_utils import EngineArgs

    state += [selector._cached_get_attn_backend, vars(EngineArgs)["create_engine_config"]]
    from vllm.v1.engine.core_client import EngineCoreClient

    state += [vars(EngineCoreClient)["make_client"], vars(EngineCoreClient)["make_async_mp_client"]]
    state.append(logging.getLogRecordFactory())  # the failure recorder (_failures) comes off
    state.append(dict(vars(type(AttentionBackendEnum))))  # the metaclass: iteration comes back
    for enum_cls in (AttentionBackendEnum, MambaAttentionBackendEnum):
        state += [
            dict(enum_cls._member_map_),
            list(enum_cls._member_names_),
            dict(enum_cls._value2member_map_),
            {n: v for n, v in vars(enum_cls).items() if not n.startswith("__")},
        ]
    return tuple(state)
