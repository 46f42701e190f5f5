"""attn_di's pytest plugin, loaded by pytest through the ``pytest11`` entry point ``attn_di``
(the top-level module ``_attn_di_pytest``, which imports this one: if ``import attn_di``
refuses an inherited ``ATTN_DI_REGISTRATIONS``, it stands in for this plugin, so only the tests
that use attn_di's fixtures or marker fail, with attn_di's message, not every test suite).

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

Options: ``--attn-di-conform=TARGET`` (repeatable) collects the conformance kit's cells of
each target as tests (:mod:`attn_di.conformance`; items ``attn-di-conform[TARGET]::CELL``,
marked ``attn_di_conform``, so ``-m attn_di_conform`` runs only them);
``--attn-di-conform-full`` the full matrix, ``--attn-di-conform-seed=N`` its seed,
``--attn-di-conform-shard=K/N`` only the K-th of N shards of the cells.

Nothing is autouse except the marker hook, which only looks for the marker. Importing this
module imports attn_di (light: no torch, no entry-point scan); the kit is imported only when
``--attn-di-conform`` is given.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attn_di._container import BackendContainer
from attn_di._testing import OverrideBackendFixture, isolated_backends
from attn_di.exceptions import AttnDIError

__all__ = [
    "attn_di_container",
    "override_backend",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
]

MARKER = "attention_backend"
CONFORM_MARKER = "attn_di_conform"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--attn-di-conform=TARGET`` (repeatable), ``--attn-di-conform-full``,
    ``--attn-di-conform-seed=N``."""
    group = parser.getgroup("attn_di", "attn_di's conformance kit")
    group.addoption(
        "--attn-di-conform",
        action="append",
        default=[],
        metavar="TARGET",
        help="collect the conformance kit's cells of TARGET as tests (a member name such as "
        "CPU_ATTN, or a class path pkg.module:Backend; repeatable)",
    )
    group.addoption(
        "--attn-di-conform-full",
        action="store_true",
        default=False,
        help="the full matrix instead of the default pairwise one (long)",
    )
    group.addoption(
        "--attn-di-conform-seed",
        type=int,
        default=0,
        metavar="N",
        help="the seed of the conformance cells (default 0)",
    )
    group.addoption(
        "--attn-di-conform-shard",
        default=None,
        metavar="K/N",
        help="only the K-th of N shards of the conformance cells (N CI jobs share one run)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Add the cells of every ``--attn-di-conform`` target (before ``-k``/``-m`` select)."""
    targets = config.getoption("attn_di_conform", default=None) or []
    if not targets:
        return
    from attn_di.conformance._pytest import collect_items

    try:
        found = collect_items(
            session,
            targets,
            full=bool(config.getoption("attn_di_conform_full")),
            seed=int(config.getoption("attn_di_conform_seed")),
            shard=config.getoption("attn_di_conform_shard"),
        )
    except AttnDIError as error:
        raise pytest.UsageError(f"--attn-di-conform: {error}") from error
    for item in found:
        item.add_marker(CONFORM_MARKER)
    items.extend(found)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``attention_backend`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(member, impl, *, local=False): override an attention backend for the test "
        "(impl: a class, a dotted path or a callable; or pass one mapping {member: impl}); "
        "see attn_di's README",
    )
    config.addinivalue_line(
        "markers", f"{CONFORM_MARKER}: a cell of attn_di's conformance kit (--attn-di-conform)"
    )


@pytest.fixture
def attn_di_container() -> Iterator[BackendContainer]:
    """A fresh default attn_di container; fails the test if it leaks an override layer."""
    with isolated_backends() as isolation:
        yield isolation.container
    if isolation.leaks:
        pytest.fail(isolation.leak_report(), pytrace=False)


@pytest.fixture
def override_backend(attn_di_container: BackendContainer) -> Iterator[OverrideBackendFixture]:
    """Override attention backends for this test: ``override_backend(member, impl)``."""
    overrides = OverrideBackendFixture(attn_di_container)
    yield overrides
    overrides.stopall()


@pytest.fixture(autouse=True)
def _attn_di_markers(request: pytest.FixtureRequest) -> None:
    """Apply ``@pytest.mark.attention_backend`` markers, farthest first (the closest wins)."""
    markers = list(request.node.iter_markers(MARKER))
    if not markers:
        return
    overrides: OverrideBackendFixture = request.getfixturevalue("override_backend")
    for marker in reversed(markers):
        try:
            overrides(*marker.args, **marker.kwargs)
        except (AttnDIError, TypeError) as error:
            arguments = ", ".join(
                [repr(arg) for arg in marker.args]
                + [f"{key}={value!r}" for key, value in marker.kwargs.items()]
            )
            pytest.fail(f"@pytest.mark.{MARKER}({arguments}): {error}", pytrace=False)
