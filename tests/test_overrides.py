"""``with container.override(...)``: layers above registrations, exact-restore, any exit order."""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from dependency_injector import containers, providers

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    BackendOverride,
    InvalidBackendTypeError,
    InvalidClassPathError,
    UnknownBackendError,
    register_backend,
)

CUSTOM = AttentionBackendEnum.CUSTOM
TRITON = AttentionBackendEnum.TRITON_ATTN


class FakeA:
    """A stand-in backend."""


class FakeB:
    """Another stand-in backend."""


def test_override_applies_at_once_and_restores(container: BackendContainer) -> None:
    """Inside the block the override wins everywhere; after it, the default is back."""
    with container.override(TRITON, FakeA) as handle:
        assert isinstance(handle, BackendOverride)
        assert handle.active
        assert container.backend(TRITON) is FakeA
        assert TRITON.get_class() is FakeA
        assert container.TRITON_ATTN() is FakeA
        assert TRITON.is_overridden()
        assert container.source(TRITON) == "override"
        assert TRITON.get_path() == f"{__name__}.FakeA"
    assert not handle.active
    assert not TRITON.is_overridden()
    assert TRITON.get_path() == TRITON.value


def test_override_by_name_path_and_mapping(container: BackendContainer) -> None:
    """Members may be names, impls may be dotted paths, and a mapping overrides several."""
    with container.override("CUSTOM", "collections.OrderedDict"):
        assert container.backend(CUSTOM) is collections.OrderedDict
    with container.override({TRITON: FakeA, "CUSTOM": FakeB}) as handle:
        assert container.backend(TRITON) is FakeA
        assert container.backend(CUSTOM) is FakeB
        assert handle.impls == {TRITON: FakeA, CUSTOM: FakeB}
    assert container.active_overrides() == []


def test_override_with_a_mock(container: BackendContainer, mocker: Any) -> None:
    """A mock is returned as is by resolution."""
    fake = mocker.Mock(spec=FakeA)
    with container.override(TRITON, fake):
        assert container.backend(TRITON) is fake


def test_override_wins_over_registration(container: BackendContainer) -> None:
    """A registration beneath an override is hidden inside the block and back after it."""
    register_backend(TRITON, FakeA)
    with container.override(TRITON, FakeB):
        assert container.backend(TRITON) is FakeB
    assert container.backend(TRITON) is FakeA


def test_registration_inside_a_block_is_kept(container: BackendContainer) -> None:
    """register_backend inside a block changes the registration beneath, kept after the block."""
    with container.override(TRITON, FakeA):
        register_backend(TRITON, FakeB)
        assert container.backend(TRITON) is FakeA
    assert container.backend(TRITON) is FakeB
    assert container.source(TRITON) == "registered"


def test_clear_inside_a_block_is_kept(container: BackendContainer) -> None:
    """clear_override inside a block clears the registration, not the block's layer."""
    register_backend(CUSTOM, FakeB)
    with container.override(CUSTOM, FakeA):
        CUSTOM.clear_override()
        assert container.backend(CUSTOM) is FakeA
        assert CUSTOM.is_overridden()
    assert not CUSTOM.is_overridden()


def test_nested_blocks(container: BackendContainer) -> None:
    """Nested blocks unwind one layer at a time."""
    with container.override(TRITON, FakeA):
        with container.override(TRITON, FakeB):
            assert container.backend(TRITON) is FakeB
        assert container.backend(TRITON) is FakeA
    assert not TRITON.is_overridden()


def test_out_of_order_exits_remove_only_their_own_layer(container: BackendContainer) -> None:
    """Exiting the outer block first leaves the inner block's layer in place."""
    outer = container.override(TRITON, FakeA)
    inner = container.override(TRITON, FakeB)
    outer.__exit__(None, None, None)
    assert container.backend(TRITON) is FakeB
    inner.__exit__(None, None, None)
    assert not TRITON.is_overridden()
    assert container.get_path(TRITON) == TRITON.value


def test_out_of_order_exits_with_different_members(container: BackendContainer) -> None:
    """Layers over different members exit independently."""
    first = container.override({TRITON: FakeA, CUSTOM: FakeA})
    second = container.override(CUSTOM, FakeB)
    first.restore()
    assert container.backend(CUSTOM) is FakeB
    assert not TRITON.is_overridden()
    second.restore()
    assert container.active_overrides() == []


def test_exception_inside_a_block_restores(container: BackendContainer) -> None:
    """A block that raises still removes its layer, and the exception propagates."""
    register_backend(TRITON, FakeA)
    with pytest.raises(RuntimeError, match="boom"), container.override(TRITON, FakeB):
        raise RuntimeError("boom")
    assert container.backend(TRITON) is FakeA


def test_restore_twice_is_a_no_op(container: BackendContainer) -> None:
    """A handle restored twice does not touch later layers."""
    first = container.override(TRITON, FakeA)
    first.restore()
    second = container.override(TRITON, FakeB)
    first.restore()
    assert container.backend(TRITON) is FakeB
    second.restore()


@pytest.mark.parametrize(
    ("member", "impl", "error"),
    [
        (TRITON, None, InvalidBackendTypeError),
        (TRITON, 42, InvalidBackendTypeError),
        (TRITON, "not a path", InvalidClassPathError),
        ("TRITON_ATN", FakeA, UnknownBackendError),
        ({TRITON: FakeA, "NOPE": FakeB}, None, UnknownBackendError),
        ({TRITON: FakeA, CUSTOM: 42}, None, InvalidBackendTypeError),
    ],
)
def test_bad_overrides_change_nothing(
    member: Any, impl: Any, error: type[Exception], container: BackendContainer
) -> None:
    """An invalid override raises before any layer is applied."""
    args = (member,) if isinstance(member, dict) else (member, impl)
    with pytest.raises(error):
        container.override(*args)
    assert container.active_overrides() == []


def test_missing_impl_is_a_type_error(container: BackendContainer) -> None:
    """override(member) without an impl says what is missing."""
    with pytest.raises(InvalidBackendTypeError, match="impl must be given"):
        container.override(TRITON)
    with pytest.raises(InvalidBackendTypeError, match="omitted when a mapping is given"):
        container.override({TRITON: FakeA}, FakeB)


def test_dependency_injector_override_is_honoured(container: BackendContainer) -> None:
    """dependency-injector's own provider.override sits above everything and invalidates caches."""
    register_backend(TRITON, FakeA)
    assert container.backend(TRITON) is FakeA
    with container.TRITON_ATTN.override(providers.Object(FakeB)):
        assert container.backend(TRITON) is FakeB
        assert TRITON.get_class() is FakeB
        assert container.source(TRITON) == "di override"
    assert container.backend(TRITON) is FakeA


def test_container_override_with_a_container_keeps_di_semantics(
    container: BackendContainer,
) -> None:
    """container.override(other_container) still does dependency-injector's container override."""
    other = BackendContainer()
    other.TRITON_ATTN.override(providers.Object(FakeA))
    container.override(other)
    try:
        assert container.backend(TRITON) is FakeA
    finally:
        container.reset_last_overriding()
        container.TRITON_ATTN.reset_override()
    assert container.source(TRITON) == "default"


def test_container_override_as_a_block_restores(container: BackendContainer) -> None:
    """``with container.override(other_container):`` undoes dependency-injector's override."""
    other = BackendContainer()
    other.TRITON_ATTN.override(providers.Object(FakeA))
    register_backend(TRITON, FakeB)
    with container.override(other):
        assert container.backend(TRITON) is FakeA
        assert TRITON in container.active_overrides()  # every same-named provider is
        assert container.get_path(TRITON) == f"{__name__}.FakeA"
    assert container.backend(TRITON) is FakeB
    assert container.active_overrides() == []


@pytest.fixture(name="wired")
def _wired(container: BackendContainer) -> Iterator[BackendContainer]:
    """The test's container wired to this module (wiring adds its ``__self__`` provider)."""
    container.wire(modules=[sys.modules[__name__]])
    try:
        yield container
    finally:
        container.unwire()


def _overriding_container(kind: str) -> Any:
    """A container overriding TRITON_ATTN with FakeA: a whole BackendContainer, or a
    dependency-injector container holding that one provider."""
    if kind == "backend-container":
        other = BackendContainer()
        other.TRITON_ATTN.override(providers.Object(FakeA))
        return other
    other = containers.DynamicContainer()
    other.TRITON_ATTN = providers.Object(FakeA)
    return other


@pytest.mark.parametrize("kind", ["backend-container", "one-provider"])
@pytest.mark.parametrize("ending", ["normally", "with-an-exception"])
def test_a_container_override_of_a_wired_container_undoes_exactly_itself(
    wired: BackendContainer, kind: str, ending: str
) -> None:
    """``with wired.override(other_container):`` on a wired container restores at the exit,
    normally or with an exception from the body, which propagates as it was: the exit raised
    dependency-injector's "Provider Self(...) is not overridden" (it walked the ``__self__``
    provider wire() adds, and every provider the other container lacks), replacing the
    body's exception and leaving the handle active."""
    register_backend(TRITON, FakeB)
    self_overrides = wired.providers["__self__"].overridden
    other = _overriding_container(kind)

    with contextlib.ExitStack() as stack:
        if ending == "with-an-exception":
            stack.enter_context(pytest.raises(KeyError, match="from the body"))
        handle = stack.enter_context(wired.override(other))
        assert wired.backend(TRITON) is FakeA
        if ending == "with-an-exception":
            raise KeyError("from the body")

    assert not handle.active
    assert wired.backend(TRITON) is FakeB
    assert wired.overridden == ()
    assert wired.active_overrides() == []
    assert wired.providers["__self__"].overridden == self_overrides
    assert all(not provider.overridden for provider in wired.mamba.providers.values())
    handle.restore()  # a second restore does nothing
    assert wired.backend(TRITON) is FakeB


def test_a_restore_that_cannot_happen_never_hides_the_bodys_exception(
    container: BackendContainer,
) -> None:
    """A container override that cannot be restored at the exit (a provider overridden again
    inside the block) lets the body's exception through, with a note; nothing changes."""
    other = _overriding_container("one-provider")
    with (  # noqa: PT012
        pytest.raises(KeyError, match="from the body") as info,
        container.override(other) as handle,
    ):
        container.TRITON_ATTN.override(providers.Object(FakeB))
        raise KeyError("from the body")
    assert any("was not restored" in note for note in info.value.__notes__)
    assert handle.active
    assert container.backend(TRITON) is FakeB
    container.TRITON_ATTN.reset_last_overriding()
    handle.restore()
    assert container.active_overrides() == []


def test_duplicate_members_in_a_mapping(container: BackendContainer) -> None:
    """A mapping naming one member twice (member and name) is refused."""
    with pytest.raises(InvalidBackendTypeError, match="CUSTOM appears twice"):
        container.override({CUSTOM: FakeA, "CUSTOM": FakeB})
    assert container.active_overrides() == []


def test_overrides_are_per_container(container: BackendContainer) -> None:
    """An override in one container is invisible to another."""
    other = BackendContainer()
    with container.override(TRITON, FakeA):
        assert other.get_path(TRITON) == TRITON.value


def test_isinstance_and_repr(container: BackendContainer) -> None:
    """Instances are BackendContainers, with a repr listing registrations and overrides."""
    assert isinstance(container, BackendContainer)
    register_backend(CUSTOM, FakeA)
    with container.override(TRITON, FakeB) as handle:
        text = repr(container)
        assert "registered=['CUSTOM']" in text
        assert "overridden=['TRITON_ATTN']" in text
        assert repr(handle) == "<BackendOverride active: TRITON_ATTN=FakeB>"
        assert "TRITON_ATTN" in repr(container.TRITON_ATTN)
