"""Resolving class paths: lazy, cached, and failing with the precise cause."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from attn_di import AttentionBackendEnum, BackendContainer, BackendImportError, register_backend

CUSTOM = AttentionBackendEnum.CUSTOM

BACKEND_MODULE = """
import builtins
builtins.attn_di_test_imports = getattr(builtins, "attn_di_test_imports", 0) + 1

class Backend:
    pass

class Outer:
    class Inner:
        pass
"""


def _import_count() -> int:
    import builtins

    return int(getattr(builtins, "attn_di_test_imports", 0))


def test_nothing_is_imported_until_resolved(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """Registering a path imports nothing; the first resolution imports once, then caches."""
    module = make_module("lazy_pkg.backend_mod", BACKEND_MODULE)
    register_backend(CUSTOM, f"{module}.Backend")
    assert module not in sys.modules
    first = container.backend(CUSTOM)
    assert first.__name__ == "Backend"
    assert module in sys.modules
    count = _import_count()
    del sys.modules[module]  # a cached class does not go back to the import system
    assert container.backend(CUSTOM) is first
    assert CUSTOM.get_class() is first
    assert _import_count() == count


def test_nested_class_paths(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """``pkg.mod.Outer.Inner`` and ``pkg.mod:Outer.Inner`` both resolve a nested class."""
    module = make_module("nested_pkg.mod", BACKEND_MODULE)
    register_backend(CUSTOM, f"{module}.Outer.Inner")
    assert container.backend(CUSTOM).__qualname__ == "Outer.Inner"
    register_backend(CUSTOM, f"{module}:Outer.Inner")
    assert container.backend(CUSTOM).__qualname__ == "Outer.Inner"
    assert CUSTOM.get_path(include_classname=False) == module


def test_module_not_found(container: BackendContainer) -> None:
    """A missing module is an ImportError naming the member, the path and the cause."""
    with pytest.raises(BackendImportError) as caught:
        container.backend(AttentionBackendEnum.FLASH_ATTN)
    error = caught.value
    assert isinstance(error, ImportError)
    assert error.member == "FLASH_ATTN"
    assert error.class_path == AttentionBackendEnum.FLASH_ATTN.value
    assert error.reason == "module not found"
    assert isinstance(error.__cause__, ModuleNotFoundError)
    assert "FLASH_ATTN" in str(error)
    assert "Hint: vLLM is not installed here: set it up with `bash scripts/setup-vllm.sh`" in str(
        error
    )


def test_missing_submodule_of_an_existing_package(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """A missing module inside an existing package is "module not found", naming that module."""
    make_module("present_pkg.other", BACKEND_MODULE)
    register_backend(CUSTOM, "present_pkg.absent_mod.Backend")
    with pytest.raises(BackendImportError) as caught:
        container.backend(CUSTOM)
    assert caught.value.reason == "module not found"
    assert "present_pkg.absent_mod" in str(caught.value)


def test_attribute_not_found_suggests_the_closest(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """A missing class names the module and suggests the closest name it has."""
    module = make_module("attr_pkg.mod", BACKEND_MODULE)
    register_backend(CUSTOM, f"{module}.Backnd")
    with pytest.raises(BackendImportError) as caught:
        container.backend(CUSTOM)
    assert caught.value.reason == "attribute not found"
    assert caught.value.suggestion == "Backend"
    assert isinstance(caught.value.__cause__, AttributeError)
    assert str(caught.value).endswith("Hint: did you mean 'Backend'?")


def test_module_failing_on_import_is_chained(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """A module that raises while importing is reported as such, its error chained."""
    module = make_module("broken_pkg.mod", "raise RuntimeError('kernel library missing')\n")
    register_backend(CUSTOM, f"{module}.Backend")
    with pytest.raises(BackendImportError) as caught:
        container.backend(CUSTOM)
    assert caught.value.reason == "module failed to import"
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "kernel library missing" in str(caught.value)


def test_missing_dependency_of_a_module_is_not_module_not_found(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """A module whose own import of a missing package fails is "failed", not "not found"."""
    module = make_module("dep_pkg.mod", "import attn_di_no_such_dependency\n")
    register_backend(CUSTOM, f"{module}.Backend")
    with pytest.raises(BackendImportError) as caught:
        container.backend(CUSTOM)
    assert caught.value.reason == "module failed to import"
    assert "attn_di_no_such_dependency" in str(caught.value)


def test_failed_import_is_not_cached(
    make_module: Callable[[str, str], str], container: BackendContainer
) -> None:
    """After a failure, a module that becomes importable resolves on the next call."""
    register_backend(CUSTOM, "late_pkg.mod.Backend")
    with pytest.raises(BackendImportError):
        container.backend(CUSTOM)
    make_module("late_pkg.mod", BACKEND_MODULE)
    assert container.backend(CUSTOM).__name__ == "Backend"


@pytest.mark.parametrize(
    "code",
    [
        "import attn_di",
        "import attn_di; attn_di.get_container(); attn_di.AttentionBackendEnum.CPU_ATTN.get_path()",
        "import attn_di; attn_di.register_backend('CUSTOM', 'attn_di.backends.cpu_attn.X')",
    ],
)
def test_import_attn_di_stays_light(code: str) -> None:
    """Importing and using the registry imports no torch, vLLM or backend module."""
    check = (
        f"{code}; import sys; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'numpy')"
        " or m.startswith('attn_di.backends')]; print(heavy)"
    )
    output = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]"
