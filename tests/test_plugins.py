"""Plugins: the tiny distribution in tests/plugin_dist, loaded through its entry points.

The distribution is installed for the test session only (the ``test_plugin`` fixture in
conftest.py), never into the environment a user runs.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import ModuleType

import pytest

from attn_di import (
    AttentionBackendEnum,
    BackendContainer,
    PluginRecord,
    load_plugins,
    plugin_report,
)

DISTRIBUTION = "attn-di-test-plugin"


def _by_name(records: tuple[PluginRecord, ...]) -> dict[str, PluginRecord]:
    return {record.name: record for record in records}


def test_allowlist_loads_only_the_named_plugins(
    monkeypatch: pytest.MonkeyPatch, container: BackendContainer, test_plugin: ModuleType
) -> None:
    """ATTN_DI_PLUGINS=tiny loads tiny only; the others are reported as skipped."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", " tiny ,")
    report = load_plugins()
    assert [record.name for record in report.loaded] == ["tiny"]
    assert {record.name for record in report.skipped} == {"extra", "broken", "unimportable"}
    assert report.failed == ()
    assert report.allowlist == ("tiny",)
    assert container.backend("TINY_ATTN") is test_plugin.TinyBackend
    assert container.source(AttentionBackendEnum.CUSTOM) == "unset"


@pytest.mark.usefixtures("test_plugin")
def test_empty_allowlist_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTN_DI_PLUGINS set to an empty string allows no plugin."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "")
    report = load_plugins()
    assert report.loaded == ()
    assert len(report.skipped) == 4


def test_registrations_are_attributed_to_the_distribution(
    monkeypatch: pytest.MonkeyPatch, container: BackendContainer, test_plugin: ModuleType
) -> None:
    """Each loaded plugin names its distribution and members; their source is "plugin"."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny,extra")
    report = load_plugins()
    records = _by_name(report.loaded)
    assert records["tiny"].distribution == DISTRIBUTION
    assert records["tiny"].version == "0.1.0"
    assert records["tiny"].value == "attn_di_test_plugin:register_tiny"
    assert records["tiny"].members == ("TINY_ATTN",)
    assert records["extra"].members == ("CUSTOM",)
    assert container.source("TINY_ATTN") == "plugin"
    assert container.source(AttentionBackendEnum.CUSTOM) == "plugin"
    assert container.backend(AttentionBackendEnum.CUSTOM) is test_plugin.ExtraBackend
    assert report.origin(AttentionBackendEnum.CUSTOM) is records["extra"]
    assert report.origin("TINY_ATTN") is records["tiny"]
    assert report.origin("FLASH_ATTN") is None
    assert plugin_report() is report


@pytest.mark.usefixtures("test_plugin")
def test_a_raising_plugin_is_reported_and_the_others_load(
    monkeypatch: pytest.MonkeyPatch,
    container: BackendContainer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """broken raises: logged with its traceback, reported, rolled back; tiny still loads."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "broken,tiny")
    with caplog.at_level(logging.INFO, logger="attn_di.plugins"):
        report = load_plugins()
    assert [record.name for record in report.loaded] == ["tiny"]
    (failed,) = report.failed
    assert failed.name == "broken"
    assert failed.distribution == DISTRIBUTION
    assert failed.error == "RuntimeError: the broken test plugin fails on purpose"
    assert failed.traceback is not None
    assert "in broken" in failed.traceback
    # its partial registrations are gone: the runtime member and the FLASH_ATTN registration
    assert "BROKEN_ATTN" not in AttentionBackendEnum.__members__
    assert container.source(AttentionBackendEnum.FLASH_ATTN) == "default"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "'broken'" in errors[0].getMessage()
    assert DISTRIBUTION in errors[0].getMessage()
    assert errors[0].exc_info is not None
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    assert loaded == [f"loaded attn_di plugin 'tiny' from {DISTRIBUTION} (registered TINY_ATTN)"]


@pytest.mark.usefixtures("test_plugin")
def test_an_unimportable_plugin_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry point whose module does not import is a failed plugin, not a crash."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "unimportable")
    (failed,) = load_plugins().failed
    assert failed.error is not None
    assert failed.error.startswith("ModuleNotFoundError")


def test_loading_is_idempotent(monkeypatch: pytest.MonkeyPatch, test_plugin: ModuleType) -> None:
    """A second call runs no plugin again (failed ones included) and keeps the report."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny,broken")
    calls = dict(test_plugin.CALLS)
    first = load_plugins()
    second = load_plugins()
    assert second.plugins[:2] == first.plugins[:2]
    assert test_plugin.CALLS["tiny"] == calls.get("tiny", 0) + 1
    assert test_plugin.CALLS["broken"] == calls.get("broken", 0) + 1
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny,broken,extra")  # a newly allowed one loads
    third = load_plugins()
    assert [record.name for record in third.loaded] == ["tiny", "extra"]
    assert test_plugin.CALLS["tiny"] == calls.get("tiny", 0) + 1


@pytest.mark.usefixtures("test_plugin")
def test_allowlisted_name_with_no_plugin_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A name in ATTN_DI_PLUGINS that no entry point has is reported and logged."""
    monkeypatch.setenv("ATTN_DI_PLUGINS", "tiny,tinny")
    report = load_plugins()
    assert report.missing == ("tinny",)
    assert "names 'tinny', but no such plugin is installed" in caplog.text


def test_the_test_distribution_is_not_installed_in_the_environment() -> None:
    """Outside the ``test_plugin`` fixture no process sees the test plugins (a clean list)."""
    check = (
        "from importlib.metadata import entry_points; "
        "print(sorted(ep.value for ep in entry_points(group='attn_di.plugins') "
        "if ep.value.startswith('attn_di_test_plugin')))"
    )
    output = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]"


def test_plugin_state_is_fresh_in_each_test() -> None:
    """The attn_di_container fixture gives each test an empty plugin report."""
    assert plugin_report().plugins == ()


def test_import_attn_di_reads_no_entry_points() -> None:
    """``import attn_di`` neither scans entry points nor imports ray."""
    check = (
        "import sys, attn_di; "
        "print(sorted(m for m in ('importlib.metadata', 'ray', 'pytest') if m in sys.modules))"
    )
    output = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]"
