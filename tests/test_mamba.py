"""MambaAttentionBackendEnum: every guarantee of the attention enum, through one mechanism."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector.wiring import Provide, inject

import attn_di
from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    MambaAttentionBackendEnum,
    MambaBackendContainer,
    UnknownBackendError,
    register_backend,
)

M = MambaAttentionBackendEnum


class FakeMamba:
    """A module-level Mamba backend stand-in."""


FAKE_PATH = f"{__name__}.FakeMamba"


@inject
def _engine(mamba_cls: Any = Provide[BackendContainer.mamba.MAMBA2]) -> Any:
    return mamba_cls


def test_declared_providers_cover_the_enum() -> None:
    """MambaBackendContainer declares one provider per built-in Mamba member (typed access)."""
    declared = {name for name in vars(MambaBackendContainer) if name.isupper()}
    assert declared >= {m.name for m in M}


def test_lazy_providers(container: BackendContainer) -> None:
    """Nothing is imported before resolution; a missing module is a typed import error."""
    assert "vllm" not in sys.modules
    provider = container.mamba.MAMBA2
    assert provider.get_path() == M.MAMBA2.value
    with pytest.raises(ImportError, match="MAMBA2"):
        container.backend(M.MAMBA2)


def test_container_backend_takes_mamba_members(container: BackendContainer) -> None:
    """container.backend(member) resolves Mamba members; Mamba names go through container.mamba."""
    register_backend(M.LINEAR, "collections.OrderedDict")
    assert container.backend(M.LINEAR) is collections.OrderedDict
    assert container.mamba.backend("LINEAR") is collections.OrderedDict
    assert M.LINEAR.get_class() is collections.OrderedDict
    with pytest.raises(UnknownBackendError, match=r"MambaAttentionBackendEnum\.LINEAR"):
        container.backend("LINEAR")


def test_provide_injects_a_mamba_backend(container: BackendContainer) -> None:
    """Provide[BackendContainer.mamba.MAMBA2] injects the registered class; overrides show."""
    container.wire(modules=[sys.modules[__name__]])
    try:
        register_backend(M.MAMBA2, FAKE_PATH)
        assert _engine() is FakeMamba
        with container.override(M.MAMBA2, collections.Counter):
            assert _engine() is collections.Counter
        assert _engine() is FakeMamba
    finally:
        container.unwire()


def test_global_override_layers(container: BackendContainer) -> None:
    """Override blocks on Mamba members stack, restore exactly, and keep registrations."""
    register_backend(M.CUSTOM, FAKE_PATH)
    outer = container.override(M.CUSTOM, collections.Counter)
    inner = container.override(
        {M.CUSTOM: collections.OrderedDict, AttentionBackendEnum.CUSTOM: FakeMamba}
    )
    assert container.backend(M.CUSTOM) is collections.OrderedDict
    assert container.backend(AttentionBackendEnum.CUSTOM) is FakeMamba
    outer.restore()
    assert container.backend(M.CUSTOM) is collections.OrderedDict
    inner.restore()
    assert container.backend(M.CUSTOM) is FakeMamba
    assert container.source(M.CUSTOM) == "registered"


def test_local_override_is_thread_local(container: BackendContainer) -> None:
    """A context-local Mamba override is invisible to another thread."""
    register_backend(M.CUSTOM, FAKE_PATH)
    seen: list[Any] = []
    with container.override(M.CUSTOM, collections.Counter, local=True):
        thread = threading.Thread(target=lambda: seen.append(container.backend(M.CUSTOM)))
        thread.start()
        thread.join()
        assert container.backend(M.CUSTOM) is collections.Counter
    assert seen == [FakeMamba]
    assert container.backend(M.CUSTOM) is FakeMamba


def test_export_and_apply_keep_the_families_apart(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """Snapshots write Mamba names as "mamba:NAME"; applying recreates them in the Mamba enum."""
    name = new_name()
    register_backend(M.CUSTOM, FAKE_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, "collections.Counter")
    register_backend(name, "collections.OrderedDict", is_mamba=True)
    snapshot = container.export_registrations()
    assert snapshot == {
        "CUSTOM": "collections.Counter",
        "mamba:CUSTOM": FAKE_PATH,
        f"mamba:{name}": "collections.OrderedDict",
    }
    other = BackendContainer()
    other.apply_registrations(snapshot)
    assert other.backend(M.CUSTOM) is FakeMamba
    assert other.backend(AttentionBackendEnum.CUSTOM) is collections.Counter


def test_apply_refuses_an_unknown_family() -> None:
    """A key with an unknown family prefix is refused before anything is applied."""
    other = BackendContainer()
    with pytest.raises(ValueError, match="unknown family 'ssm'"):
        other.apply_registrations({"CUSTOM": FAKE_PATH, "ssm:CUSTOM": FAKE_PATH})
    assert not other.is_overridden(AttentionBackendEnum.CUSTOM)


def test_propagation_reaches_a_child_process(container: BackendContainer) -> None:
    """A Mamba registration reaches a child process through ATTN_DI_REGISTRATIONS."""
    register_backend(M.CUSTOM, "collections.OrderedDict")
    with attn_di.propagate_registrations() as handle:
        assert json.loads(handle.environ["ATTN_DI_REGISTRATIONS"]) == {
            "mamba:CUSTOM": "collections.OrderedDict"
        }
        code = "import attn_di; print(attn_di.MambaAttentionBackendEnum.CUSTOM.get_path())"
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
    assert result.stdout.strip() == "collections.OrderedDict"


def test_runtime_mamba_members_get_providers(new_name: Callable[[], str]) -> None:
    """A runtime Mamba member gets a provider in existing and new containers, and the class."""
    existing = BackendContainer()
    member = M.register(new_name(), "collections.OrderedDict")
    assert existing.backend(member) is collections.OrderedDict
    assert BackendContainer().backend(member) is collections.OrderedDict
    assert getattr(BackendContainer.mamba, member.name).member is member


def test_pytest_marker_and_fixture(pytester: pytest.Pytester) -> None:
    """The attention_backend marker and override_backend fixture take Mamba members."""
    pytester.makepyfile(
        """
        import collections
        import pytest
        from attn_di import MambaAttentionBackendEnum as M, get_container

        @pytest.mark.attention_backend(M.MAMBA1, "collections.OrderedDict")
        def test_marker():
            assert get_container().backend(M.MAMBA1) is collections.OrderedDict

        def test_fixture(override_backend):
            override_backend(M.GDN_ATTN, collections.Counter)
            assert M.GDN_ATTN.get_class() is collections.Counter

        def test_restored():
            assert not M.MAMBA1.is_overridden() and not M.GDN_ATTN.is_overridden()
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_cli_lists_the_mamba_enum() -> None:
    """attn-di list --json lists the Mamba members beside the attention members."""
    result = subprocess.run(
        [sys.executable, "-m", "attn_di", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**_clean_env(), "ATTN_DI_PLUGINS": ""},
    )
    listing = json.loads(result.stdout)
    assert [r["name"] for r in listing["mamba_members"]] == [m.name for m in M]
    assert "MAMBA2" not in [r["name"] for r in listing["members"]]


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("ATTN_DI_")}


def test_an_unknown_mamba_name_keeps_vllms_phrase() -> None:
    """M["X"]: vLLM's Mamba enum shares the attention enum's metaclass, so the message begins
    "Unknown attention backend" there too; it lists Mamba names only and suggests one."""
    with pytest.raises(UnknownBackendError) as caught:
        M["MAMBA3"]
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.phrase == "Unknown attention backend"
    assert error.message() == (
        "Unknown attention backend: 'MAMBA3'. Valid options are: "
        "MAMBA1, MAMBA2, SHORT_CONV, LINEAR, GDN_ATTN, CUSTOM"
    )
    assert error.suggestion == "MAMBA2"
    with pytest.raises(UnknownBackendError, match=r"^Unknown attention backend: 'FLASH_ATTN'\."):
        M["FLASH_ATTN"]


def test_the_unknown_name_phrase_is_the_familys() -> None:
    """The phrase comes from the family: a family without a vLLM wording to keep says
    "Unknown <label>", for names and for class paths; the attention enum keeps vLLM's."""
    from attn_di._enum import ATTENTION, MAMBA
    from attn_di._family import _FAMILIES, BackendEnum, BackendFamily

    class ThirdBackendEnum(BackendEnum):
        """A throwaway third enum."""

        ONLY = "collections.OrderedDict"

    family = BackendFamily(ThirdBackendEnum, "third", "third-kind backend")
    try:
        assert (ATTENTION.unknown_phrase, MAMBA.unknown_phrase) == (
            "Unknown attention backend",
            "Unknown attention backend",
        )
        assert family.unknown_phrase == "Unknown third-kind backend"
        with pytest.raises(UnknownBackendError) as by_name:
            ThirdBackendEnum["NOPE"]
        assert by_name.value.message() == (
            "Unknown third-kind backend: 'NOPE'. Valid options are: ONLY"
        )
        with pytest.raises(UnknownBackendError) as by_path:
            ThirdBackendEnum("x.y.Z")
        assert by_path.value.message().startswith("Unknown third-kind backend class path: ")
    finally:
        del _FAMILIES[ThirdBackendEnum]
