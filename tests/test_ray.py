"""Ray tasks and actors resolve the driver's registrations (attn_di.ray_runtime_env).

One local cluster (``num_cpus=1``) for the session; skipped when Ray is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attn_di import AttentionBackendEnum, get_container, ray_runtime_env, register_backend

ray = pytest.importorskip(
    "ray", reason="Ray is optional: pip install -e '.[ray]' (scripts/setup.sh installs it)"
)


@pytest.fixture(scope="session", name="ray_cluster")
def _ray_cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@pytest.mark.usefixtures("ray_cluster", "test_plugin")
def test_ray_task_and_actor_resolve_the_drivers_registrations(plugin_site: Path) -> None:
    """A remote task and an actor started with ray_runtime_env() see both registrations."""

    # Defined here so that Ray pickles them by value (workers cannot import this test module).
    def _resolve(names: list[str]) -> dict[str, tuple[str, str]]:
        import attn_di

        container = attn_di.get_container()
        return {
            name: (container.get_path(name), container.backend(name).__name__) for name in names
        }

    register_backend(AttentionBackendEnum.CUSTOM, "attn_di_test_plugin.ExtraBackend")
    register_backend("RAY_ATTN", "attn_di_test_plugin:TinyBackend")  # a runtime member
    # the workers import the backends from the test plugin's site directory
    runtime_env = ray_runtime_env({"env_vars": {"PYTHONPATH": str(plugin_site)}})
    names = ["CUSTOM", "RAY_ATTN"]
    expected = {
        "CUSTOM": ("attn_di_test_plugin.ExtraBackend", "ExtraBackend"),
        "RAY_ATTN": ("attn_di_test_plugin:TinyBackend", "TinyBackend"),
    }
    assert _resolve(names) == expected  # the driver itself

    resolve_task = ray.remote(_resolve)
    assert ray.get(resolve_task.options(runtime_env=runtime_env).remote(names)) == expected

    class Resolver:
        def resolve(self, names: list[str]) -> dict[str, tuple[str, str]]:
            return _resolve(names)

    actor: Any = ray.remote(Resolver).options(runtime_env=runtime_env).remote()
    try:
        assert ray.get(actor.resolve.remote(names)) == expected
    finally:
        ray.kill(actor)
    assert get_container().source("RAY_ATTN") == "registered"  # vLLM >= 0.32: a new name registers
