"""The ``vllm.general_plugins`` entry point ``attn_di``, as vLLM loads it in a fresh process.

Each case is a new interpreter calling vLLM's own ``load_general_plugins()`` (what the front
end, the engine core and every worker do), with ``ATTN_DI_REGISTRATIONS`` set as a parent's
propagation would leave it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from tests.vllm.conftest import CPU_ATTN_PATH

PROBE = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.attention.backends import registry
from attn_di.integrations import vllm as bridge
print(json.dumps({
    "installed": bridge.is_installed(),
    "register_backend": registry.register_backend.__module__,
    "cpu_attn": registry.AttentionBackendEnum.CPU_ATTN.get_path(),
}))
"""


def _probe(**env: str) -> dict[str, object]:
    environment = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",)}
    environment.update(env, ATTN_DI_REGISTRATIONS=json.dumps({"CPU_ATTN": CPU_ATTN_PATH}))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=environment
    )
    assert result.returncode == 0, result.stderr
    answer: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


def test_the_entry_point_is_declared() -> None:
    """attn_di's distribution declares the plugin vLLM looks for."""
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["attn_di"] == "attn_di.integrations.vllm:load_plugin"


def test_vllm_loading_its_plugins_installs_the_bridge() -> None:
    """In a fresh process, vLLM's plugin loading installs the bridge, and the inherited
    ATTN_DI_REGISTRATIONS is what vLLM's CPU_ATTN resolves to."""
    assert _probe() == {
        "installed": True,
        "register_backend": "attn_di.integrations.vllm._bridge",
        "cpu_attn": CPU_ATTN_PATH,
    }


def test_vllm_plugins_allowlist_applies() -> None:
    """VLLM_PLUGINS naming other plugins only: attn_di's is not loaded, vLLM is untouched."""
    assert _probe(VLLM_PLUGINS="lora_filesystem_resolver") == {
        "installed": False,
        "register_backend": "vllm.v1.attention.backends.registry",
        "cpu_attn": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
    }
    assert _probe(VLLM_PLUGINS="attn_di")["installed"] is True


@pytest.mark.parametrize("value", ["0", "Off "])
def test_attn_di_vllm_bridge_off_turns_it_off(value: str) -> None:
    """ATTN_DI_VLLM_BRIDGE=0 (any off spelling: "Off " was on): the plugin loads but leaves
    vLLM as it is."""
    answer = _probe(ATTN_DI_VLLM_BRIDGE=value)
    assert answer["installed"] is False
    assert answer["register_backend"] == "vllm.v1.attention.backends.registry"


def test_attn_di_vllm_bridge_junk_is_refused_by_name() -> None:
    """ATTN_DI_VLLM_BRIDGE=disable installed the bridge; now vLLM's plugin loading stops
    with attn_di's EnvSwitchError naming the variable (vLLM lets a plugin's error through)."""
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    environment["ATTN_DI_VLLM_BRIDGE"] = "disable"
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=environment
    )
    assert result.returncode != 0
    assert "EnvSwitchError: ATTN_DI_VLLM_BRIDGE: is 'disable', not one of" in result.stderr
