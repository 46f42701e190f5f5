"""The ``pytest11`` entry point of attn_di: :mod:`attn_di.pytest_plugin`, loaded by pytest in
every session of the environment, or its stand-in when attn_di refuses to start.

``import attn_di`` applies an inherited ``ATTN_DI_REGISTRATIONS`` and refuses a malformed one
(``RegistrationsEnvError``). Raised while pytest loads its plugins, that would abort every
test suite of the environment, those that never use attn_di too. So this module, outside the
``attn_di`` package, imports the plugin and, if attn_di refuses to start, stands in for it:
the marker is registered as usual, and the tests that use attn_di's fixtures or marker fail
with attn_di's message; the others run.
"""

from __future__ import annotations

import sys

import pytest

__all__ = ["MARKER", "pytest_addoption", "pytest_collection_modifyitems", "pytest_configure"]

MARKER = "attention_backend"

try:
    from attn_di.pytest_plugin import (
        _attn_di_markers,
        attn_di_container,
        override_backend,
        pytest_addoption,
        pytest_collection_modifyitems,
        pytest_configure,
    )
except ValueError as _error:
    # attn_di.exceptions was imported before the package's __init__ refused the variable.
    _refused = getattr(sys.modules.get("attn_di.exceptions"), "RegistrationsEnvError", None)
    if _refused is None or not isinstance(_error, _refused):
        raise
    _MESSAGE = f"attn_di's pytest fixtures cannot start: {_error}"
    del _error, _refused

    def pytest_configure(config: pytest.Config) -> None:
        """Register the ``attention_backend`` marker (so ``--strict-markers`` accepts it)."""
        config.addinivalue_line(
            "markers", f"{MARKER}(member, impl, *, local=False): attn_di could not start"
        )

    def pytest_addoption(parser: pytest.Parser) -> None:
        """The options, so that a command line naming them still parses."""
        group = parser.getgroup("attn_di", "attn_di's conformance kit")
        group.addoption("--attn-di-conform", action="append", default=[], metavar="TARGET")
        group.addoption("--attn-di-conform-full", action="store_true", default=False)
        group.addoption("--attn-di-conform-seed", type=int, default=0, metavar="N")

    def pytest_collection_modifyitems(
        session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        """``--attn-di-conform`` cannot run: attn_di refused to start."""
        if config.getoption("attn_di_conform", default=None):
            raise pytest.UsageError(_MESSAGE)

    @pytest.fixture
    def attn_di_container() -> None:
        """Fails the test: attn_di refused to start (see the message)."""
        pytest.fail(_MESSAGE, pytrace=False)

    @pytest.fixture
    def override_backend() -> None:
        """Fails the test: attn_di refused to start (see the message)."""
        pytest.fail(_MESSAGE, pytrace=False)

    @pytest.fixture(autouse=True)
    def _attn_di_markers(request: pytest.FixtureRequest) -> None:
        """Fails a test marked ``attention_backend``: attn_di refused to start."""
        if any(True for _ in request.node.iter_markers(MARKER)):
            pytest.fail(_MESSAGE, pytrace=False)


_exported = (_attn_di_markers, attn_di_container, override_backend)  # found by pytest
