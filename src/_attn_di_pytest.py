"""attn_di's pytest plugin, loaded by pytest in every session through the ``pytest11`` entry
point ``attn_di`` (documented as :mod:`attn_di.pytest_plugin`, which re-exports it).

It lives outside the ``attn_di`` package so that loading it imports nothing of attn_di:
``import attn_di`` applies an inherited ``ATTN_DI_REGISTRATIONS`` and refuses a malformed
one, which must not abort a test suite that never uses attn_di. attn_di is imported, and
the variable checked, at the first use of a fixture or of the marker; a malformed value
then fails that test with attn_di's error.

Fixtures:

- ``attn_di_container``: a fresh default container for the test (also a clean ``ATTN_DI_*``
  environment and plugin state, and automatic propagation off: call
  ``attn_di.set_auto_propagation(True)`` in a test that starts workers relying on it);
  runtime members the test adds (in either enum) are removed after it; the test fails (an
  error at teardown) if it leaves an override layer active.
- ``override_backend`` (:class:`attn_di.OverrideBackendFixture`): overrides restored when
  the test ends; uses ``attn_di_container``.

Marker: ``@pytest.mark.attention_backend(member, impl, local=False)`` (or a mapping
``{member: impl}``; members of either enum) overrides for one test, class or module; the
marker closest to the test wins.

Nothing is autouse except the marker hook, which only looks for the marker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from attn_di import BackendContainer, OverrideBackendFixture

__all__ = ["MARKER", "attn_di_container", "override_backend", "pytest_configure"]

MARKER = "attention_backend"


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``attention_backend`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(member, impl, *, local=False): override an attention backend for the test "
        "(impl: a class, a dotted path or a callable; or pass one mapping {member: impl}); "
        "see attn_di's README",
    )


@pytest.fixture
def attn_di_container() -> Iterator[BackendContainer]:
    """A fresh default attn_di container; fails the test if it leaks an override layer."""
    testing = _attn_di_testing()
    with testing.isolated_backends() as isolation:
        yield isolation.container
    if isolation.leaks:
        pytest.fail(isolation.leak_report(), pytrace=False)


@pytest.fixture
def override_backend(attn_di_container: BackendContainer) -> Iterator[OverrideBackendFixture]:
    """Override attention backends for this test: ``override_backend(member, impl)``."""
    overrides = _attn_di_testing().OverrideBackendFixture(attn_di_container)
    yield overrides
    overrides.stopall()


@pytest.fixture(autouse=True)
def _attn_di_markers(request: pytest.FixtureRequest) -> None:
    """Apply ``@pytest.mark.attention_backend`` markers, farthest first (the closest wins)."""
    markers = list(request.node.iter_markers(MARKER))
    if not markers:
        return
    overrides: OverrideBackendFixture = request.getfixturevalue("override_backend")
    from attn_di.exceptions import AttnDIError

    for marker in reversed(markers):
        try:
            overrides(*marker.args, **marker.kwargs)
        except (AttnDIError, TypeError) as error:
            arguments = ", ".join(
                [repr(arg) for arg in marker.args]
                + [f"{key}={value!r}" for key, value in marker.kwargs.items()]
            )
            pytest.fail(f"@pytest.mark.{MARKER}({arguments}): {error}", pytrace=False)


def _attn_di_testing() -> ModuleType:
    """``attn_di._testing``, imported now; an ``ATTN_DI_REGISTRATIONS`` that ``import attn_di``
    refuses fails the test that asked for attn_di, with attn_di's message."""
    try:
        from attn_di import _testing
    except ValueError as error:
        # attn_di.exceptions was imported before the package's __init__ refused the value.
        exceptions = sys.modules.get("attn_di.exceptions")
        refused = getattr(exceptions, "RegistrationsEnvError", None)
        if refused is None or not isinstance(error, refused):
            raise
        message = f"attn_di's pytest fixtures cannot start: {error}"
    else:
        return _testing
    pytest.fail(message, pytrace=False)
