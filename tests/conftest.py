"""Every test gets a fresh default container and a clean ATTN_DI_* environment.

Through the ``attn_di_container`` fixture of attn_di's own pytest plugin: a test that leaves
an override layer active (global or context-local) fails, and runtime members it adds are
removed after it.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from attn_di import BackendContainer

pytest_plugins = ["pytester"]

_names = itertools.count()


@pytest.fixture(autouse=True, name="container")
def _container(attn_di_container: BackendContainer) -> BackendContainer:
    """The test's fresh default container (attn_di's ``attn_di_container`` fixture)."""
    return attn_di_container


@pytest.fixture(name="new_name")
def _new_name() -> Callable[[], str]:
    """A factory of runtime member names unused in this process (members are process-wide)."""
    return lambda: f"RUNTIME_{os.getpid()}_{next(_names)}"


@pytest.fixture(name="make_module")
def _make_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, str], str]]:
    """Write an importable module ``name`` with ``source`` under tmp_path; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def make(name: str, source: str) -> str:
        path = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in list(path.parents)[: name.count(".")]:
            parent.joinpath("__init__.py").touch()
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        created.append(name)
        return name

    yield make
    packages = {name.split(".")[0] for name in created}
    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            del sys.modules[name]
