"""One name rule for every entry point that takes a member name typed by a user.

``container.backend``, ``container.override``, ``container.provider`` (and the methods built
on it), ``select_backend``, ``force_backend``, ``ATTN_DI_BACKEND``, ``parse_backend_name`` and
the CLI read a name the same way (any case, ``-`` or a space for ``_``, the exact name first)
and suggest the same closest name. ``AttentionBackendEnum[...]`` and ``register_backend`` keep
vLLM's exact-name semantics.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from attn_di import (
    AttentionBackendEnum,
    AttentionSelectorConfig,
    BackendContainer,
    BackendImportError,
    UnknownBackendError,
    force_backend,
    parse_backend_name,
    register_backend,
    select_backend,
)
from attn_di.cli import main
from attn_di.exceptions import AttnDIWarning, closest_name

E = AttentionBackendEnum
CONFIG = AttentionSelectorConfig(head_size=64, dtype="float32", block_size=16)

SPELLINGS = [
    ("CPU_ATTN", E.CPU_ATTN),
    ("cpu_attn", E.CPU_ATTN),
    ("Cpu_Attn", E.CPU_ATTN),
    ("cpu-attn", E.CPU_ATTN),
    ("CPU ATTN", E.CPU_ATTN),
    ("  cpu_attn ", E.CPU_ATTN),
    ("torch sdpa", E.TORCH_SDPA),
    ("Torch-SDPA", E.TORCH_SDPA),
    ("flex--attention", E.FLEX_ATTENTION),
]
"""(what a user types, the member it names): the one table every entry point reads."""


def _via_backend(container: BackendContainer, name: str) -> Any:
    return container.backend(name)


def _via_provider(container: BackendContainer, name: str) -> Any:
    return container.provider(name).resolve()


def _via_get_path(container: BackendContainer, name: str) -> Any:
    path = container.get_path(name)
    return next(container.backend(m) for m in E if m.default_path == path)


def _via_override(container: BackendContainer, name: str) -> Any:
    with container.override(name, type("Marker", (), {})):
        (member,) = (m for m in E if container.source(m) == "override")
    return container.backend(member)


def _via_select(container: BackendContainer, name: str) -> Any:
    return select_backend(CONFIG, device="cpu", backend=name).backend_cls


def _via_force(container: BackendContainer, name: str) -> Any:
    with force_backend(name):
        return select_backend(CONFIG, device="cpu").backend_cls


def _via_parse(container: BackendContainer, name: str) -> Any:
    return container.backend(parse_backend_name(name))


ENTRY_POINTS: dict[str, Callable[[BackendContainer, str], Any]] = {
    "container.backend": _via_backend,
    "container.provider": _via_provider,
    "container.get_path": _via_get_path,
    "container.override": _via_override,
    "select_backend(backend=)": _via_select,
    "force_backend": _via_force,
    "parse_backend_name": _via_parse,
}


@pytest.mark.parametrize(("typed", "member"), SPELLINGS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_python_entry_point_reads_the_same_spellings(
    container: BackendContainer, entry: str, typed: str, member: E
) -> None:
    """Each spelling of the table names its member through each Python entry point."""
    assert ENTRY_POINTS[entry](container, typed) is container.backend(member)


@pytest.mark.parametrize(("typed", "member"), SPELLINGS)
def test_the_environment_variable_reads_the_same_spellings(
    monkeypatch: pytest.MonkeyPatch, typed: str, member: E
) -> None:
    """ATTN_DI_BACKEND takes every spelling of the table."""
    monkeypatch.setenv("ATTN_DI_BACKEND", typed)
    assert select_backend(CONFIG, device="cpu").backend is member


@pytest.mark.parametrize(("typed", "member"), SPELLINGS)
@pytest.mark.parametrize("how", ["--backend", "ATTN_DI_BACKEND"])
def test_the_cli_reads_the_same_spellings(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
    typed: str,
    member: E,
) -> None:
    """`attn-di select` takes every spelling of the table, as --backend and from the variable."""
    args = ["select", "--head-size", "64", "--dtype", "float32", "--json"]
    if how == "--backend":
        args += ["--backend", typed]
    else:
        monkeypatch.setenv("ATTN_DI_BACKEND", typed)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == member.name


SUGGESTIONS = [
    ("TRITON", "TRITON_ATTN"),  # starts with it: the first such member, not TRITON_MLA
    ("triton", "TRITON_ATTN"),
    ("sdpa", "TORCH_SDPA"),  # the one member with that word
    ("flex", "FLEX_ATTENTION"),
    ("cpu_atn", "CPU_ATTN"),  # the closest spelling
    ("flash-att", "FLASH_ATTN"),
]
"""(a name that is no member, the suggestion every entry point makes)."""


def _raise_backend(container: BackendContainer, name: str) -> None:
    container.backend(name)


def _raise_override(container: BackendContainer, name: str) -> None:
    container.override(name, object)


def _raise_select(container: BackendContainer, name: str) -> None:
    select_backend(CONFIG, device="cpu", backend=name)


def _raise_force(container: BackendContainer, name: str) -> None:
    with force_backend(name):
        pass


def _raise_enum(container: BackendContainer, name: str) -> None:
    E[name]


RAISERS: dict[str, Callable[[BackendContainer, str], None]] = {
    "container.backend": _raise_backend,
    "container.override": _raise_override,
    "select_backend(backend=)": _raise_select,
    "force_backend": _raise_force,
    "AttentionBackendEnum[...]": _raise_enum,
}


@pytest.mark.parametrize(("typed", "suggestion"), SUGGESTIONS)
@pytest.mark.parametrize("entry", RAISERS)
def test_every_entry_point_suggests_the_same_name(
    container: BackendContainer, entry: str, typed: str, suggestion: str
) -> None:
    """An unknown name raises UnknownBackendError whose hint is the same closest member."""
    with pytest.raises(UnknownBackendError) as caught:
        RAISERS[entry](container, typed)
    assert caught.value.suggestion == suggestion
    assert caught.value.hint == f"did you mean {suggestion!r}?"


@pytest.mark.parametrize(("typed", "suggestion"), SUGGESTIONS)
def test_the_environment_variable_suggests_the_same_name(
    monkeypatch: pytest.MonkeyPatch, typed: str, suggestion: str
) -> None:
    """ATTN_DI_BACKEND's unknown name gets the same suggestion (and is never ignored)."""
    monkeypatch.setenv("ATTN_DI_BACKEND", typed)
    with pytest.raises(UnknownBackendError) as caught:
        select_backend(CONFIG, device="cpu")
    assert caught.value.suggestion == suggestion


@pytest.mark.parametrize(("typed", "suggestion"), SUGGESTIONS)
@pytest.mark.parametrize("how", ["--backend", "ATTN_DI_BACKEND"])
def test_the_cli_suggests_the_same_name(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
    typed: str,
    suggestion: str,
) -> None:
    """`attn-di select` refuses the name in one line, exit 2, with the same suggestion."""
    args = ["select", "--head-size", "64", "--dtype", "float32"]
    if how == "--backend":
        args += ["--backend", typed]
        expected = f"hint: did you mean {suggestion!r}?"
    else:
        monkeypatch.setenv("ATTN_DI_BACKEND", typed)
        expected = f"hint: did you mean ATTN_DI_BACKEND={suggestion}?"
    assert main(args) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("typed", "command"), [("runn", "run"), ("lst", "list"), ("selct", "select")]
)
def test_an_unknown_cli_command_gets_did_you_mean(
    capsys: pytest.CaptureFixture[str], typed: str, command: str
) -> None:
    """An unknown command is one error line naming the commands, and the closest one."""
    with pytest.raises(SystemExit) as caught:
        main([typed])
    assert caught.value.code == 2
    error, hint = capsys.readouterr().err.splitlines()
    choices = "list, select, run, conform"
    assert error == f"attn-di: error: unknown command {typed!r} (choose from {choices})"
    assert hint == f"hint: did you mean `attn-di {command}`? see `attn-di --help`"


def test_a_register_path_typo_gets_the_class_name_suggestion(
    container: BackendContainer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --register path whose class is misspelt gets the Python API's suggestion, fixed path
    included, not "use --backend auto"."""
    path = "attn_di.backends.torch_sdpa:TorchSDPABackendd"
    register_backend("MY_TYPO", path)
    with pytest.raises(BackendImportError) as python_api:
        container.backend("MY_TYPO")
    assert python_api.value.hint == "did you mean 'TorchSDPABackend'?"
    code = main(["--register", f"MY_TYPO={path}", "select", "--head-size", "64",
                 "--dtype", "float32", "--backend", "MY_TYPO"])  # fmt: skip
    assert code == 1
    hint = capsys.readouterr().err.splitlines()[-1]
    assert hint == (
        "hint: did you mean 'TorchSDPABackend'? (attn_di.backends.torch_sdpa:TorchSDPABackend)"
    )


def test_the_enum_and_register_backend_keep_exact_names(container: BackendContainer) -> None:
    """Enum[...] takes exact names only; register_backend with a new spelling makes a new
    member (vLLM's semantics), and from then on that exact name means the new member."""
    with pytest.raises(UnknownBackendError):
        E["cpu_attn"]
    with pytest.warns(AttnDIWarning, match="only by case"):
        register_backend("cpu_attn", "collections.OrderedDict")
    assert E["cpu_attn"] is not E.CPU_ATTN
    assert container.backend("cpu_attn").__name__ == "OrderedDict"  # the exact name wins
    assert container.backend("CPU_ATTN") is container.backend(E.CPU_ATTN)


def test_members_differing_only_by_case_stay_distinguishable(
    container: BackendContainer,
) -> None:
    """Exact names reach each of two case variants; a third spelling matching both is
    refused, naming them, rather than guessed."""
    register_backend("Mine_Case", "collections.OrderedDict")
    with pytest.warns(AttnDIWarning):
        register_backend("MINE_CASE", "collections.Counter")
    assert container.backend("Mine_Case").__name__ == "OrderedDict"
    assert container.backend("MINE_CASE").__name__ == "Counter"
    with pytest.raises(UnknownBackendError) as caught:
        container.backend("mine-case")
    assert caught.value.hint == (
        "'mine-case' matches 'Mine_Case', 'MINE_CASE', which differ only by case: "
        "give the exact name"
    )


def test_a_lower_case_runtime_member_is_found_by_any_spelling(
    container: BackendContainer,
) -> None:
    """A runtime member spelled in lower case is reached by its upper-case spelling too."""
    register_backend("my_lower_attn", "collections.OrderedDict")
    assert container.backend("MY-LOWER-ATTN").__name__ == "OrderedDict"
    with force_backend("My Lower Attn") as member:
        assert member is E["my_lower_attn"]


@pytest.mark.parametrize(
    ("typed", "choices", "expected"),
    [
        ("TRITON", ["TRITON_MLA", "TRITON_ATTN"], "TRITON_MLA"),  # the first that starts so
        ("sdpa", ["TORCH_SDPA", "FLASH_ATTN"], "TORCH_SDPA"),
        ("attn", ["FLASH_ATTN", "TRITON_ATTN"], None),  # a word of several: no guess
        ("--registr", ["--import", "--register"], "--register"),
        ("bfloat", ["float32", "bfloat16"], "bfloat16"),
        ("xy", ["FLASH_ATTN"], None),
        ("", ["FLASH_ATTN"], None),
    ],
)
def test_closest_name(typed: str, choices: list[str], expected: str | None) -> None:
    """The suggestion rule: same spelling, then the first prefix match (3+ characters), then
    the only member with that word, then the closest spelling."""
    assert closest_name(typed, choices) == expected
