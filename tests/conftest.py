"""Every test gets a fresh default container and a clean ATTN_DI_* environment.

Through the ``attn_di_container`` fixture of attn_di's own pytest plugin: a test that leaves
an override layer active (global or context-local) fails, and runtime members it adds are
removed after it.

The test plugin distribution (tests/plugin_dist) is never installed in the project's
environment: the ``test_plugin`` fixture installs it into a session-scoped site directory
and puts that on ``sys.path`` (and ``PYTHONPATH``, for subprocesses) for one test only.
"""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

from attn_di import BackendContainer

pytest_plugins = ["pytester"]

# scripts/check.sh (CI) runs with --hypothesis-profile=ci: the same examples on every run, so a
# red CI is a change's doing. A plain `pytest` draws new examples each run (the default profile).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)

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


PLUGIN_DIST = Path(__file__).parent / "plugin_dist"


@pytest.fixture(scope="session", name="plugin_site")
def _plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory holding tests/plugin_dist, installed by pip for this session only.

    A real installation (a dist-info with entry_points.txt), so ``importlib.metadata`` finds
    its ``attn_di.plugins`` entry points exactly as it would in a user's environment. It is
    built from a copy, so the checkout gets no build/ or egg-info.
    """
    root = tmp_path_factory.mktemp("plugin_dist")
    source = shutil.copytree(
        PLUGIN_DIST, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    site = root / "site"
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
        "--no-build-isolation", "--disable-pip-version-check", "--target", str(site), str(source),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode:
        pytest.fail(f"cannot install tests/plugin_dist:\n{result.stdout}{result.stderr}")
    return site


@pytest.fixture(name="test_plugin")
def _test_plugin(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The test plugin distribution, importable and discoverable for this test only.

    Its site directory is prepended to ``sys.path`` and to ``PYTHONPATH`` (subprocesses such as
    ``attn-di`` see it too); yields its module ``attn_di_test_plugin``.
    """
    monkeypatch.syspath_prepend(str(plugin_site))
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(plugin_site), *([inherited] if inherited else [])])
    )
    importlib.invalidate_caches()
    yield importlib.import_module("attn_di_test_plugin")
    sys.modules.pop("attn_di_test_plugin", None)
