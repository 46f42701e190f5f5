"""BackendContainer: declared providers, the default container, runtime members."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    BackendProvider,
    InvalidBackendTypeError,
    get_container,
    register_backend,
    use_container,
)
from attn_di._enum import remove_runtime_member, runtime_members


def test_declared_providers_cover_the_builtin_members() -> None:
    """Each built-in member is a BackendProvider declared in the class body (typed Provide[])."""
    declared = {
        name: value
        for name, value in vars(BackendContainer).items()
        if isinstance(value, BackendProvider)
    }
    builtin = [m for m in AttentionBackendEnum if m not in runtime_members()]
    assert set(declared) == {m.name for m in builtin}
    assert all(declared[m.name].member is m for m in builtin)


def test_every_instance_has_its_own_providers(container: BackendContainer) -> None:
    """Instances hold copies: state in one never reaches the class or another instance."""
    other = BackendContainer()
    assert container.TRITON_ATTN is not other.TRITON_ATTN
    assert container.TRITON_ATTN is not BackendContainer.TRITON_ATTN
    register_backend(AttentionBackendEnum.TRITON_ATTN, "collections.Counter")
    assert other.source(AttentionBackendEnum.TRITON_ATTN) == "default"
    assert BackendContainer().source(AttentionBackendEnum.TRITON_ATTN) == "default"


def test_get_container_is_the_installed_default(container: BackendContainer) -> None:
    """get_container returns the default installed by use_container (the autouse fixture)."""
    assert get_container() is container


def test_use_container_nests_and_restores(container: BackendContainer) -> None:
    """Nested use_container blocks install and restore defaults in order."""
    mine = BackendContainer()
    with use_container(mine) as outer:
        assert outer is mine
        assert get_container() is mine
        with use_container() as inner:
            assert get_container() is inner
            register_backend(AttentionBackendEnum.CUSTOM, "collections.OrderedDict")
        assert get_container() is mine
        assert not AttentionBackendEnum.CUSTOM.is_overridden()
    assert get_container() is container


def test_removing_a_runtime_member(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """remove_runtime_member takes the member and its providers away everywhere."""
    name = new_name()
    member = AttentionBackendEnum.register(name, "collections.OrderedDict")
    assert container.backend(name) is collections.OrderedDict
    remove_runtime_member(member)
    assert name not in AttentionBackendEnum.__members__
    assert name not in BackendContainer.providers
    assert name not in container.providers
    assert member not in runtime_members()


def test_use_container_checks_its_argument(container: BackendContainer) -> None:
    """Only BackendContainer instances can be installed; the default is left alone."""
    for bad in (5, BackendContainer):
        with pytest.raises(InvalidBackendTypeError), use_container(bad):  # type: ignore[arg-type]
            pass
    assert get_container() is container


def test_use_container_out_of_order_exits(container: BackendContainer) -> None:
    """Exiting an outer block first keeps the inner one the default until it exits."""
    outer_block, inner_block = use_container(), use_container()
    outer = outer_block.__enter__()
    inner = inner_block.__enter__()
    outer_block.__exit__(None, None, None)
    assert get_container() is inner
    assert outer is not inner
    inner_block.__exit__(None, None, None)
    assert get_container() is container
