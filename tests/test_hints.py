"""Install hints are commands that work for attn_di as published (from a clone) and name the
extra that provides the missing module."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attn_di.exceptions import (
    EXTRA_OF_MODULE,
    BackendImportError,
    MissingExtraError,
    UnknownBackendError,
    install_hint,
    missing_module_hint,
)

ROOT = Path(__file__).resolve().parents[1]
EXTRAS: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]


def _requirement_names(extra: str) -> set[str]:
    return {re.split(r"[<>=!\[; ]", requirement, maxsplit=1)[0] for requirement in EXTRAS[extra]}


@pytest.mark.parametrize(("module", "extra"), sorted(EXTRA_OF_MODULE.items()))
def test_every_module_maps_to_an_extra_that_installs_it(module: str, extra: str) -> None:
    """The extra a hint names exists in pyproject and lists the module's distribution."""
    assert module in _requirement_names(extra)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_an_install_hint_is_a_command_from_a_clone(extra: str) -> None:
    """``pip install -e '.[extra]'`` in the clone, pinned torch first where the extra has torch."""
    hint = install_hint(extra)
    assert f"pip install -e '.[{extra}]'" in hint
    if "torch" in _requirement_names(extra):
        assert hint.index("pip install torch==2.13.0") < hint.index("pip install -e")
    else:
        assert "torch" not in hint


def test_no_hint_names_an_unpublished_distribution() -> None:
    """No source file tells users to ``pip install attn-di[...]`` (it is not on PyPI)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"pip install[^\n]*attn[-_]di\[", line)
    ]
    assert offenders == []


def test_missing_extra_error_names_the_extra_and_the_command() -> None:
    """MissingExtraError's hint is install_hint(extra)."""
    error = MissingExtraError("transformers", "attn_di.integrations.transformers")
    assert error.hint == install_hint("transformers")
    assert str(error).endswith(
        "Hint: in attn_di's clone: pip install torch==2.13.0, then pip install -e "
        "'.[transformers]' (the 'transformers' extra)"
    )


def test_a_backend_without_torch_names_the_torch_extra() -> None:
    """CPU_ATTN resolved where torch is missing: the hint installs the torch extra."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from attn_di import get_container\n"
        "try:\n    get_container().backend('CPU_ATTN')\n"
        "except ImportError as exc:\n    print(exc.hint)\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == f"torch is not installed: {install_hint('torch')}"


def test_a_vllm_member_without_vllm_says_how_to_set_vllm_up() -> None:
    """A member whose default is vLLM's class names vLLM's set-up and attn_di's own members."""
    error = BackendImportError(
        "TRITON_ATTN",
        "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
        BackendImportError.MODULE_NOT_FOUND,
        "No module named 'vllm'",
        missing_module="vllm",
    )
    assert error.hint == missing_module_hint("vllm")
    assert "bash scripts/setup-vllm.sh" in error.hint
    assert "CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION" in error.hint


def test_an_unknown_missing_module_keeps_the_generic_hint() -> None:
    """A module no extra provides: install the package, or register another class."""
    assert missing_module_hint("my_pkg") is None
    error = BackendImportError(
        "CUSTOM", "my_pkg.B", BackendImportError.MODULE_NOT_FOUND, "x", missing_module="my_pkg"
    )
    assert error.hint is not None
    assert error.hint.startswith("install the package that provides it")


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("attention", "register_backend('MY_NEW_BACKEND', 'my_pkg.module.MyBackend')"),
        ("mamba", "register_backend('MY_NEW_BACKEND', 'my_pkg.module.MyBackend', is_mamba=True)"),
    ],
)
def test_an_unknown_name_with_nothing_close_hints_at_register_backend(
    family: str, expected: str
) -> None:
    """The hint for a name close to no member teaches the call the docs teach."""
    from attn_di import get_container

    container = get_container()
    lookup = container.backend if family == "attention" else container.mamba.backend
    with pytest.raises(UnknownBackendError) as caught:
        lookup("MY_NEW_BACKEND")
    assert caught.value.suggestion is None
    assert caught.value.hint == f"see `attn-di list`, or add one with `{expected}`"
