"""AttentionBackendEnum: members, values, name lookup, pickling and runtime members."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest

from attn_di import (
    AttentionBackendEnum,
    AttnDIError,
    BackendContainer,
    BackendNotRegisteredError,
    InvalidBackendNameError,
    InvalidBackendTypeError,
    InvalidClassPathError,
    UnknownBackendError,
    get_container,
)
from attn_di.exceptions import AttnDIWarning

VLLM_011_MEMBERS = [
    "FLASH_ATTN", "FLASH_SINK_ATTN", "TRITON_ATTN", "XFORMERS", "ROCM_ATTN", "ROCM_AITER_MLA",
    "ROCM_AITER_FA", "TORCH_SDPA", "FLASHINFER", "FLASHINFER_MLA", "TRITON_MLA", "CUTLASS_MLA",
    "FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "PALLAS", "IPEX", "NO_ATTENTION",
    "FLEX_ATTENTION", "TREE_ATTN", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN", "CUSTOM",
]  # fmt: skip
OURS = {
    "CPU_ATTN": "attn_di.backends.cpu_attn.CPUAttentionBackend",
    "TORCH_SDPA": "attn_di.backends.torch_sdpa.TorchSDPABackend",
    "FLEX_ATTENTION": "attn_di.backends.flex_attention.FlexAttentionBackend",
    "NO_ATTENTION": "attn_di.backends.no_attention.NoAttentionBackend",
}
BUILTIN = [m for m in AttentionBackendEnum if m.name in VLLM_011_MEMBERS]


def test_members_are_vllm_011s_in_order() -> None:
    """The built-in members are exactly vLLM 0.11's, in its order, each listed once."""
    assert [m.name for m in BUILTIN] == VLLM_011_MEMBERS
    assert list(AttentionBackendEnum.__members__)[: len(VLLM_011_MEMBERS)] == VLLM_011_MEMBERS


def test_custom_is_distinct_from_torch_sdpa() -> None:
    """CUSTOM is its own member, never an alias of TORCH_SDPA (vLLM's old bug)."""
    custom, sdpa = AttentionBackendEnum.CUSTOM, AttentionBackendEnum.TORCH_SDPA
    assert custom is not sdpa
    assert custom.name == "CUSTOM"
    assert custom in list(AttentionBackendEnum)
    assert len({m.value for m in BUILTIN}) == len(BUILTIN)


@pytest.mark.parametrize("member", BUILTIN, ids=lambda m: m.name)
def test_default_paths(member: AttentionBackendEnum) -> None:
    """attn_di's own members point at attn_di.backends, others at vLLM, CUSTOM at nothing."""
    if member.name == "CUSTOM":
        assert member.default_path is None
    elif member.name in OURS:
        assert member.value == OURS[member.name]
    else:
        assert member.value.startswith("vllm.v1.attention.backends.")
        assert member.value.rsplit(".", 1)[1].endswith("Backend")


def test_unknown_name_is_a_value_error_with_choices_and_suggestion() -> None:
    """Enum["X"] names X, lists every valid name and suggests the closest."""
    with pytest.raises(UnknownBackendError) as caught:
        AttentionBackendEnum["TRITON_ATN"]
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, AttnDIError)
    assert error.name == "TRITON_ATN"
    assert error.suggestion == "TRITON_ATTN"
    assert set(VLLM_011_MEMBERS) <= set(error.choices)
    message = str(error)
    assert "'TRITON_ATN'" in message
    assert all(name in message for name in VLLM_011_MEMBERS)
    assert message.endswith("Hint: did you mean 'TRITON_ATTN'?")


def test_unknown_name_suggests_the_right_case() -> None:
    """A lower-case spelling of a member is suggested in its real case."""
    with pytest.raises(UnknownBackendError) as caught:
        AttentionBackendEnum["flash_attn"]
    assert caught.value.suggestion == "FLASH_ATTN"


@pytest.mark.parametrize("name", ["all", "ALL", " All "])
def test_all_is_not_a_member_and_suggests_none(name: str) -> None:
    """Enum["all"]: vLLM's message, no suggestion (PALLAS only contains 'all'), and a hint
    naming the one command where `all` means every backend."""
    with pytest.raises(UnknownBackendError) as caught:
        AttentionBackendEnum[name]
    assert str(caught.value).startswith(f"Unknown attention backend: {name!r}. Valid options")
    assert caught.value.suggestion is None
    assert caught.value.hint == (
        "`all` is accepted only by `attn-di run --backend all`; "
        "elsewhere give one backend name (see `attn-di list`)"
    )


def test_a_member_called_all_is_looked_up_normally() -> None:
    """Once a runtime member named ``all`` exists, a near miss is suggested as usual."""
    AttentionBackendEnum.register("all", "collections.OrderedDict")  # removed by conftest
    with pytest.raises(UnknownBackendError) as caught:
        AttentionBackendEnum["ALL"]
    assert caught.value.suggestion == "all"


def test_unknown_name_without_anything_close() -> None:
    """A name close to nothing gets no suggestion and a hint on how to add members."""
    with pytest.raises(UnknownBackendError) as caught:
        AttentionBackendEnum["ZZZZZZZZZZZZ"]
    assert caught.value.suggestion is None
    assert "register_backend('ZZZZZZZZZZZZ', " in str(caught.value)


def test_get_path_default_and_module_part() -> None:
    """get_path gives the default path; include_classname=False gives the module part."""
    member = AttentionBackendEnum.TRITON_ATTN
    assert member.get_path() == "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    assert member.get_path(include_classname=False) == "vllm.v1.attention.backends.triton_attn"
    assert not member.is_overridden()


def test_custom_before_registration_says_how_to_register() -> None:
    """CUSTOM with nothing registered raises a ValueError naming register_backend."""
    for call in (AttentionBackendEnum.CUSTOM.get_path, AttentionBackendEnum.CUSTOM.get_class):
        with pytest.raises(BackendNotRegisteredError) as caught:
            call()
        assert isinstance(caught.value, ValueError)
        assert caught.value.member == "CUSTOM"
        assert "register_backend(AttentionBackendEnum.CUSTOM" in str(caught.value)


def test_clear_override_without_registration_is_a_no_op() -> None:
    """clear_override on an untouched member changes nothing and raises nothing."""
    AttentionBackendEnum.FLASH_ATTN.clear_override()
    assert not AttentionBackendEnum.FLASH_ATTN.is_overridden()


def test_lookup_by_unknown_value() -> None:
    """AttentionBackendEnum(value) for an unknown path raises the typed error."""
    assert AttentionBackendEnum(OURS["CPU_ATTN"]) is AttentionBackendEnum.CPU_ATTN
    with pytest.raises(UnknownBackendError, match="is the default of no AttentionBackendEnum"):
        AttentionBackendEnum("bogus")


def test_members_pickle_by_name() -> None:
    """Members round-trip through pickle to the same object."""
    for member in AttentionBackendEnum:
        assert pickle.loads(pickle.dumps(member)) is member


def test_runtime_member(new_name: Callable[[], str], container: BackendContainer) -> None:
    """register() adds a member with its own provider here and in new containers."""
    name = new_name()
    other = BackendContainer()
    member = AttentionBackendEnum.register(name, "collections.OrderedDict")
    assert AttentionBackendEnum[name] is member
    assert getattr(AttentionBackendEnum, name) is member
    assert list(AttentionBackendEnum)[-1] is member
    assert member.value == "collections.OrderedDict"
    import collections

    assert member.get_class() is collections.OrderedDict
    assert other.backend(name) is collections.OrderedDict
    assert BackendContainer().backend(member) is collections.OrderedDict
    assert name in BackendContainer.providers
    assert pickle.loads(pickle.dumps(member)) is member
    assert not member.is_overridden()


def test_runtime_member_default_is_what_clear_returns_to(
    new_name: Callable[[], str], container: BackendContainer
) -> None:
    """A runtime member's given path is its default: clear_override() returns to it."""
    member = AttentionBackendEnum.register(new_name(), "collections.OrderedDict")
    container.register(member, "collections.Counter")
    assert member.get_path() == "collections.Counter"
    member.clear_override()
    assert member.get_path() == "collections.OrderedDict"


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("FLASH_ATTN", InvalidBackendNameError),
        ("register", InvalidBackendNameError),
        ("get_path", InvalidBackendNameError),
        ("name", InvalidBackendNameError),
        ("_PRIVATE", InvalidBackendNameError),
        ("__dunder__", InvalidBackendNameError),
        ("1ABC", InvalidBackendNameError),
        ("MY-BACKEND", InvalidBackendNameError),
        ("", InvalidBackendNameError),
        ("class", InvalidBackendNameError),
        ("backend", InvalidBackendNameError),
        ("providers", InvalidBackendNameError),
        ("wire", InvalidBackendNameError),
        (42, InvalidBackendTypeError),
    ],
)
def test_runtime_member_names_refused(name: object, error: type[Exception]) -> None:
    """Duplicates (any case), enum attributes, private and non-identifier names are refused."""
    before = list(AttentionBackendEnum)
    with pytest.raises(error) as caught:
        AttentionBackendEnum.register(name, "collections.OrderedDict")  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError | TypeError)
    assert list(AttentionBackendEnum) == before


def test_runtime_member_duplicate_hint_names_the_existing_member() -> None:
    """An existing name is refused in vLLM's words, with a hint to override that member."""
    with pytest.raises(InvalidBackendNameError, match="already exists") as caught:
        AttentionBackendEnum.register("TRITON_ATTN", "a.B")
    assert caught.value.existing == "TRITON_ATTN"
    assert "register_backend(AttentionBackendEnum.TRITON_ATTN" in str(caught.value)


def test_runtime_member_case_variant_is_accepted_with_a_warning(
    new_name: Callable[[], str],
) -> None:
    """A name differing from a member only by case is a new member (as in vLLM), with a warning."""
    with pytest.warns(AttnDIWarning, match="differs from 'TRITON_ATTN' only by case"):
        member = AttentionBackendEnum.register("Triton_Attn", "collections.OrderedDict")
    assert member is not AttentionBackendEnum.TRITON_ATTN
    assert AttentionBackendEnum["Triton_Attn"] is member


def test_runtime_member_malformed_path(new_name: Callable[[], str]) -> None:
    """A malformed path is refused before the member is added."""
    name = new_name()
    with pytest.raises(InvalidClassPathError):
        AttentionBackendEnum.register(name, "not a path")
    assert name not in AttentionBackendEnum.__members__
    assert name not in BackendContainer.providers
    assert name not in get_container().providers
