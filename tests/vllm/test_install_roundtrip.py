"""install() and uninstall() against the real vLLM: with nothing registered while installed,
uninstall() leaves both registries as they were before install() (vLLM's dicts, attn_di's
registrations and member tables, ``ATTN_DI_REGISTRATIONS``), and using a vLLM-only member
(an override block, a registration then cleared) exports nothing.

Each test takes the bridge down first (the session fixture installed it) and puts it back.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from vllm.v1.attention.backends import registry
from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum

import attn_di
from attn_di.integrations import vllm as bridge

TORCH_SDPA = "attn_di.backends.torch_sdpa.TorchSDPABackend"
NO_ATTENTION = "attn_di.backends.no_attention.NoAttentionBackend"
VLLM_ONLY = "FLASH_ATTN_DIFFKV"  # a vLLM 0.32 member attn_di does not declare


@pytest.fixture(autouse=True, name="uninstalled")
def _uninstalled() -> Iterator[None]:
    """The bridge taken down, automatic propagation on (ATTN_DI_REGISTRATIONS follows attn_di's
    registrations); afterwards vLLM's dicts empty again and the bridge installed."""
    bridge.uninstall()
    attn_di.set_auto_propagation(True)  # the attn_di fixture restores the setting
    try:
        assert VLLM_ONLY in AttentionBackendEnum.__members__
        assert VLLM_ONLY not in attn_di.AttentionBackendEnum.__members__
        yield
    finally:
        bridge.uninstall()
        registry._ATTN_OVERRIDES.clear()
        registry._MAMBA_ATTN_OVERRIDES.clear()
        bridge.install()


def _state() -> dict[str, Any]:
    """Both registries: vLLM's module dicts (identity and contents) and member tables,
    attn_di's members, registrations, export and ATTN_DI_REGISTRATIONS."""
    container = attn_di.get_container()
    attn_di_enums = (attn_di.AttentionBackendEnum, attn_di.MambaAttentionBackendEnum)
    return {
        "vllm dicts": [
            (id(registry._ATTN_OVERRIDES), dict(registry._ATTN_OVERRIDES)),
            (id(registry._MAMBA_ATTN_OVERRIDES), dict(registry._MAMBA_ATTN_OVERRIDES)),
        ],
        "vllm members": [
            list(enum_cls._member_map_)
            for enum_cls in (AttentionBackendEnum, MambaAttentionBackendEnum)
        ],
        "attn_di members": [list(enum_cls.__members__) for enum_cls in attn_di_enums],
        "attn_di registrations": {
            member.name: container.registration(member)
            for enum_cls in attn_di_enums
            for member in enum_cls
            if container.registration(member) is not None
        },
        "exported": container.export_registrations(),
        "env": os.environ.get("ATTN_DI_REGISTRATIONS"),
    }


def test_both_sides_registrations_of_one_member_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """attn_di's registration of CPU_ATTN and vLLM's other one: attn_di's wins while installed
    (a warning names both), and after uninstall() each side holds its own again."""
    container = attn_di.get_container()
    container.register(attn_di.AttentionBackendEnum.CPU_ATTN, TORCH_SDPA)
    registry._ATTN_OVERRIDES[AttentionBackendEnum.CPU_ATTN] = NO_ATTENTION
    before = _state()
    assert before["attn_di registrations"] == {"CPU_ATTN": TORCH_SDPA}
    assert before["vllm dicts"][0][1] == {AttentionBackendEnum.CPU_ATTN: NO_ATTENTION}
    assert json.loads(before["env"]) == {"CPU_ATTN": TORCH_SDPA}

    with caplog.at_level(logging.WARNING, logger="attn_di.integrations.vllm._bridge"):
        bridge.install()
    assert [record.getMessage() for record in caplog.records] == [
        f"attn_di: CPU_ATTN is registered on both sides: attn_di's {TORCH_SDPA} is kept while "
        f"the bridge is installed (vLLM's {NO_ATTENTION} comes back on uninstall())"
    ]
    assert AttentionBackendEnum.CPU_ATTN.get_path() == TORCH_SDPA
    assert dict(registry._ATTN_OVERRIDES) == {AttentionBackendEnum.CPU_ATTN: TORCH_SDPA}
    assert container.registration(attn_di.AttentionBackendEnum.CPU_ATTN) == TORCH_SDPA
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {"CPU_ATTN": TORCH_SDPA}

    bridge.uninstall()
    assert _state() == before
    assert container.registration(attn_di.AttentionBackendEnum.CPU_ATTN) == TORCH_SDPA
    assert dict(registry._ATTN_OVERRIDES) == {AttentionBackendEnum.CPU_ATTN: NO_ATTENTION}


def test_a_migrated_registration_of_a_vllm_only_member_leaves_nothing_behind() -> None:
    """vLLM's registration of a vLLM-only member, made before install(): attn_di holds it
    (on a runtime member made for it) while installed; uninstall() removes both, and
    ATTN_DI_REGISTRATIONS is unset again."""
    vllm_member = AttentionBackendEnum[VLLM_ONLY]
    registry._ATTN_OVERRIDES[vllm_member] = TORCH_SDPA
    before = _state()
    assert before["attn_di registrations"] == {}
    assert before["env"] is None

    bridge.install()
    member = attn_di.AttentionBackendEnum[VLLM_ONLY]
    assert member.is_runtime
    assert attn_di.get_container().registration(member) == TORCH_SDPA
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {VLLM_ONLY: TORCH_SDPA}

    bridge.uninstall()
    assert _state() == before
    assert VLLM_ONLY not in attn_di.AttentionBackendEnum.__members__
    assert "ATTN_DI_REGISTRATIONS" not in os.environ
    assert dict(registry._ATTN_OVERRIDES) == {vllm_member: TORCH_SDPA}


def test_an_override_block_of_a_vllm_only_member_is_never_exported() -> None:
    """The block makes attn_di's runtime member (created on first use) and ends without a
    registration or an ATTN_DI_REGISTRATIONS entry; uninstall() removes the member."""
    before = _state()
    bridge.install()
    vllm_member = AttentionBackendEnum[VLLM_ONLY]
    container = attn_di.get_container()
    with container.override(vllm_member, TORCH_SDPA):
        assert vllm_member.get_path() == TORCH_SDPA
        assert container.export_registrations() == {}
        assert "ATTN_DI_REGISTRATIONS" not in os.environ
    member = attn_di.AttentionBackendEnum[VLLM_ONLY]
    assert container.registration(member) is None
    assert container.source(member) == "default"
    assert not vllm_member.is_overridden()
    assert container.export_registrations() == {}
    assert "ATTN_DI_REGISTRATIONS" not in os.environ

    bridge.uninstall()
    assert _state() == before
    assert VLLM_ONLY not in attn_di.AttentionBackendEnum.__members__


@pytest.mark.parametrize("clear", ["clear_override", "del"])
def test_a_cleared_registration_of_a_vllm_only_member_leaves_no_registration(clear: str) -> None:
    """register_backend(vllm_member, path) is exported; vLLM's clear_override() (or deleting
    it from vLLM's dict) leaves neither a registration nor an export of vLLM's default
    path; uninstall() removes the runtime member."""
    before = _state()
    bridge.install()
    vllm_member = AttentionBackendEnum[VLLM_ONLY]
    registry.register_backend(vllm_member, TORCH_SDPA)
    member = attn_di.AttentionBackendEnum[VLLM_ONLY]
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {VLLM_ONLY: TORCH_SDPA}
    if clear == "clear_override":
        vllm_member.clear_override()
    else:
        del registry._ATTN_OVERRIDES[vllm_member]
    container = attn_di.get_container()
    assert container.registration(member) is None
    assert not vllm_member.is_overridden()
    assert vllm_member.get_path() == vllm_member.value
    assert container.export_registrations() == {}
    assert "ATTN_DI_REGISTRATIONS" not in os.environ

    bridge.uninstall()
    assert _state() == before
    assert VLLM_ONLY not in attn_di.AttentionBackendEnum.__members__


def test_a_registration_made_while_installed_stays() -> None:
    """A vLLM-only member registered while installed keeps its runtime member and its
    registration (and ATTN_DI_REGISTRATIONS entry) after uninstall()."""
    bridge.install()
    registry.register_backend(AttentionBackendEnum[VLLM_ONLY], TORCH_SDPA)
    bridge.uninstall()
    member = attn_di.AttentionBackendEnum[VLLM_ONLY]
    assert attn_di.get_container().registration(member) == TORCH_SDPA
    assert json.loads(os.environ["ATTN_DI_REGISTRATIONS"]) == {VLLM_ONLY: TORCH_SDPA}
    assert dict(registry._ATTN_OVERRIDES) == {}


def test_every_runtime_member_made_for_vllm_only_members_goes_on_uninstall() -> None:
    """Four vLLM-only members used one after another while installed (four attn_di runtime
    members, next to each other in attn_di's enum): uninstall() removes all four."""
    before = _state()
    bridge.install()
    names = [
        name for name in AttentionBackendEnum.__members__
        if name not in attn_di.AttentionBackendEnum.__members__
    ][:4]  # fmt: skip
    assert len(names) == 4
    container = attn_di.get_container()
    for name in names:
        with container.override(AttentionBackendEnum[name], TORCH_SDPA):
            pass
    assert [n for n in attn_di.AttentionBackendEnum.__members__ if n in names] == names

    bridge.uninstall()
    assert _state() == before
    assert not set(names) & set(attn_di.AttentionBackendEnum.__members__)


def test_lookups_in_other_threads_never_fail_while_installing_and_uninstalling() -> None:
    """Threads looking members up (by name, by value, by iteration, both directions) while
    the main thread installs and uninstalls 150 times: no lookup fails and every answer is
    the member that never goes away. An attn_di runtime member is mirrored into vLLM's enum
    by each install() and removed by each uninstall(), so iterations overlap removals too."""
    import sys
    import threading

    attn_di.register_backend("I24_MIRRORED", TORCH_SDPA)  # mirrored on install, gone after
    cpu_attn = AttentionBackendEnum.CPU_ATTN
    path = cpu_attn.value
    failures: list[BaseException] = []
    wrong: list[str] = []
    stop = threading.Event()

    def look_up() -> None:
        while not stop.is_set():
            try:
                if AttentionBackendEnum["CPU_ATTN"] is not cpu_attn:
                    wrong.append("by name")
                if AttentionBackendEnum(path) is not cpu_attn:
                    wrong.append("by value")
                if cpu_attn not in list(AttentionBackendEnum):
                    wrong.append("list()")
                if cpu_attn not in list(reversed(AttentionBackendEnum)):
                    wrong.append("reversed()")
                if "CPU_ATTN" not in AttentionBackendEnum.__members__:
                    wrong.append("__members__")
            except BaseException as exc:  # what the test is about: nothing may escape
                failures.append(exc)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    readers = [threading.Thread(target=look_up) for _ in range(3)]
    try:
        for reader in readers:
            reader.start()
        for _ in range(150):
            bridge.install()
            assert "I24_MIRRORED" in AttentionBackendEnum.__members__
            bridge.uninstall()
            assert "I24_MIRRORED" not in AttentionBackendEnum.__members__
    finally:
        stop.set()
        for reader in readers:
            reader.join()
        sys.setswitchinterval(interval)
    assert failures == []
    assert wrong == []
