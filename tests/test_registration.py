"""register_backend: paths, decorators, names, wrong kinds, and all-or-nothing errors."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    InvalidBackendTypeError,
    InvalidClassPathError,
    MambaAttentionBackendEnum,
    UnknownBackendError,
    register_backend,
)

CUSTOM = AttentionBackendEnum.CUSTOM
TRITON = AttentionBackendEnum.TRITON_ATTN


def test_direct_registration_by_path(container: BackendContainer) -> None:
    """A dotted path registers; get_path, get_class and is_overridden follow it."""
    result = register_backend(TRITON, "collections.OrderedDict")
    assert result(int) is int  # vLLM returns a pass-through decorator for direct calls
    assert TRITON.get_path() == "collections.OrderedDict"
    assert TRITON.get_path(include_classname=False) == "collections"
    assert TRITON.get_class() is collections.OrderedDict
    assert TRITON.is_overridden()
    assert container.source(TRITON) == "registered"
    TRITON.clear_override()
    assert not TRITON.is_overridden()
    assert TRITON.get_path() == TRITON.value


def test_member_may_be_a_name(container: BackendContainer) -> None:
    """register_backend accepts the member's exact name."""
    register_backend("TRITON_ATTN", "collections.Counter")
    assert container.backend(TRITON) is collections.Counter


def test_decorator_returns_the_class_unchanged(container: BackendContainer) -> None:
    """@register_backend records the class and gives it back as it was."""

    class MyBackend:
        pass

    decorated = register_backend(CUSTOM)(MyBackend)
    assert decorated is MyBackend
    assert container.backend(CUSTOM) is MyBackend
    assert CUSTOM.get_path().endswith(
        "test_decorator_returns_the_class_unchanged.<locals>.MyBackend"
    )


def test_class_defined_inside_a_function_resolves() -> None:
    """A decorated class with a ``<locals>`` path still resolves in this process."""

    def make() -> type:
        @register_backend(AttentionBackendEnum.CUSTOM)
        class Local:
            pass

        return Local

    local_cls = make()
    assert "<locals>" in CUSTOM.get_path()
    assert CUSTOM.get_class() is local_cls


def test_class_may_be_passed_directly(container: BackendContainer) -> None:
    """A class given as class_path registers that class."""
    register_backend(CUSTOM, collections.OrderedDict)
    assert container.backend(CUSTOM) is collections.OrderedDict
    assert CUSTOM.get_path() == "collections.OrderedDict"


def test_last_registration_wins(container: BackendContainer) -> None:
    """Registering again replaces the previous registration."""
    register_backend(CUSTOM, "collections.OrderedDict")
    register_backend(CUSTOM, "collections.Counter")
    assert container.backend(CUSTOM) is collections.Counter


@pytest.mark.parametrize(
    "class_path",
    ["", "nodots", "a..b", " a.b", "a.b ", "a.b.", ".a.b", "1a.b", "a b.c", "a:b:c", "a.b-c"],
)
def test_malformed_paths_are_value_errors(class_path: str, container: BackendContainer) -> None:
    """Malformed paths raise InvalidClassPathError (a ValueError); the registration stays."""
    register_backend(CUSTOM, "collections.OrderedDict")
    with pytest.raises(InvalidClassPathError) as caught:
        register_backend(CUSTOM, class_path)
    assert isinstance(caught.value, ValueError)
    assert caught.value.class_path == class_path
    assert container.backend(CUSTOM) is collections.OrderedDict


@pytest.mark.parametrize("bad", [42, 1.5, b"a.b", collections.OrderedDict(), ["a.b"]])
def test_wrong_kinds_are_type_errors(bad: object, container: BackendContainer) -> None:
    """Neither a class nor a string: InvalidBackendTypeError (a TypeError); nothing changes."""
    with pytest.raises(InvalidBackendTypeError) as caught:
        register_backend(CUSTOM, bad)  # type: ignore[call-overload]
    assert isinstance(caught.value, TypeError)
    assert caught.value.argument == "class_path"
    assert not CUSTOM.is_overridden()


def test_instance_hint_suggests_the_class() -> None:
    """Passing an instance hints at passing its class."""
    with pytest.raises(InvalidBackendTypeError, match=r"pass the class itself, e\.g\. OrderedDict"):
        register_backend(CUSTOM, collections.OrderedDict())  # type: ignore[call-overload]


def test_decorator_on_a_non_class_is_a_type_error() -> None:
    """The decorator refuses functions and instances."""
    decorator = register_backend(CUSTOM)
    with pytest.raises(InvalidBackendTypeError):
        decorator(lambda: None)  # type: ignore[arg-type]
    assert not CUSTOM.is_overridden()


def test_member_of_the_wrong_kind() -> None:
    """A member that is neither a member nor a string is a TypeError, also for decorators."""
    with pytest.raises(InvalidBackendTypeError):
        register_backend(3, "a.b")  # type: ignore[call-overload]
    with pytest.raises(InvalidBackendTypeError):
        register_backend(3)  # type: ignore[call-overload]


def test_container_is_keyword_only(container: BackendContainer) -> None:
    """A container as the third positional argument (vLLM's is_mamba) is refused, not misread."""
    with pytest.raises(TypeError, match="is_mamba must be True or False"):
        register_backend(CUSTOM, "a.b", container)  # type: ignore[call-overload]
    assert not CUSTOM.is_overridden()


def test_unknown_name_makes_a_runtime_member(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """register_backend("NEW", path) adds a member valued by the path and records the
    registration (vLLM >= 0.32): is_overridden() is True until clear_override()."""
    name = new_name()
    register_backend(name, "collections.OrderedDict")
    member = AttentionBackendEnum[name]
    assert member.value == "collections.OrderedDict"
    assert member.is_overridden()
    assert container.backend(name) is collections.OrderedDict
    member.clear_override()
    assert not member.is_overridden()
    assert container.backend(name) is collections.OrderedDict


def test_decorator_with_a_new_name(new_name: Callable[[], str]) -> None:
    """@register_backend("NEW") adds a member resolving to the decorated (local) class."""
    name = new_name()

    @register_backend(name)
    class Local:
        pass

    member = AttentionBackendEnum[name]
    assert member.get_class() is Local
    assert BackendContainer().backend(member) is Local
    member.clear_override()
    assert member.get_class() is Local


def test_bad_new_name_fails_before_decorating() -> None:
    """A refused new name fails at the decorator call, before any class is involved."""
    with pytest.raises(ValueError, match="Invalid or reserved backend name: 'bad name'"):
        register_backend("bad name")


def test_unknown_member_in_other_calls(container: BackendContainer) -> None:
    """container.backend with an unknown name gives the enum's helpful error."""
    with pytest.raises(UnknownBackendError, match="did you mean 'CPU_ATTN'"):
        container.backend("CPU_ATN")
    with pytest.raises(InvalidBackendTypeError, match="member must be an AttentionBackendEnum"):
        container.backend(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidBackendTypeError):
        container.backend(["CPU_ATTN"])  # type: ignore[arg-type]


def test_a_provider_is_accepted_as_a_key(container: BackendContainer) -> None:
    """BackendContainer.X (the dependency-injector habit) names member X."""
    register_backend(CUSTOM, "collections.OrderedDict")
    assert container.backend(BackendContainer.CUSTOM) is collections.OrderedDict  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["FLASH_ATTN3", "TRITON_ATTN_V2", "FLASHINFER2", "TRITON_ATN"])
def test_plausible_new_names_are_never_refused_as_typos(
    name: str, container: BackendContainer
) -> None:
    """Names close to a member (FLASH_ATTN3, TRITON_ATTN_V2, ...) create members, as in vLLM."""
    register_backend(name, "collections.OrderedDict")
    member = AttentionBackendEnum[name]
    assert container.backend(member) is collections.OrderedDict
    assert not AttentionBackendEnum.TRITON_ATTN.is_overridden()


def test_type_error_hints_fit_the_value() -> None:
    """None gets a plain hint; an instance of a user class is told to pass the class."""
    with pytest.raises(InvalidBackendTypeError) as caught:
        register_backend(CUSTOM, 5)  # type: ignore[call-overload]
    assert "pass the class itself" not in str(caught.value)
    assert str(caught.value).endswith("Hint: pass a dotted path string or a class")


def test_container_argument_is_checked() -> None:
    """container= must be a BackendContainer instance."""
    with pytest.raises(InvalidBackendTypeError, match="container must be a BackendContainer"):
        register_backend(CUSTOM, "a.b", container=5)  # type: ignore[call-overload]


def test_export_and_apply(new_name: Callable[[], str], container: BackendContainer) -> None:
    """A JSON snapshot of registrations re-applies in another container, runtime members too."""
    name = new_name()
    register_backend(TRITON, "collections.Counter")
    register_backend(CUSTOM, collections.OrderedDict)
    register_backend(name, "collections.deque")
    snapshot = container.export_registrations()
    assert snapshot == {
        "TRITON_ATTN": "collections.Counter",
        "CUSTOM": "collections.OrderedDict",
        name: "collections.deque",
    }
    other = BackendContainer()
    other.apply_registrations(json.loads(json.dumps(snapshot)))
    assert other.backend(TRITON) is collections.Counter
    assert other.backend(CUSTOM) is collections.OrderedDict
    assert other.export_registrations() == snapshot


def test_export_skips_override_blocks(container: BackendContainer) -> None:
    """Override blocks are scoped: they are not part of the snapshot."""
    with container.override(TRITON, collections.Counter):
        assert container.export_registrations() == {}


def test_export_refuses_a_class_without_an_importable_path(container: BackendContainer) -> None:
    """A class defined in a function makes export fail, naming member and class."""

    class Hidden:
        pass

    register_backend(CUSTOM, Hidden)
    with pytest.raises(ValueError, match=r"CUSTOM: class '.*<locals>\.Hidden'") as caught:
        container.export_registrations()
    assert caught.value.member == "CUSTOM"  # type: ignore[attr-defined]


def test_apply_refuses_a_new_name_given_twice(new_name: Callable[[], str]) -> None:
    """A snapshot adding one name twice (member and mamba-less key) is refused before applying."""
    other = BackendContainer()
    name = new_name()
    snapshot = {"CUSTOM": "collections.Counter", name: "a.B", f"mamba:{name}": "a.C"}
    other.apply_registrations(snapshot)
    assert AttentionBackendEnum[name].value == "a.B"
    assert MambaAttentionBackendEnum[name].value == "a.C"
    assert other.is_overridden(CUSTOM)


def test_apply_validates_everything_first(new_name: Callable[[], str]) -> None:
    """A snapshot with one bad entry changes nothing, not even the good entries."""
    other = BackendContainer()
    name = new_name()
    bad_snapshots: list[object] = [
        {"TRITON_ATTN": "collections.Counter", "CUSTOM": "not a path"},
        {"TRITON_ATTN": "collections.Counter", name: 42},
        {"TRITON_ATTN": "collections.Counter", "bad name": "a.b"},
        {"TRITON_ATTN": "collections.Counter", CUSTOM: "a.b"},
        ["TRITON_ATTN"],
    ]
    for snapshot in bad_snapshots:
        with pytest.raises((ValueError, TypeError)):
            other.apply_registrations(snapshot)  # type: ignore[arg-type]
    assert other.export_registrations() == {}
    assert name not in AttentionBackendEnum.__members__
