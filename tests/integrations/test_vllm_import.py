"""attn_di.integrations.vllm where vLLM is not installed (the project's .venv): a typed error.

The vLLM tests themselves (tests/vllm) run in .venv-vllm; this one needs vLLM to be absent.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import attn_di


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vllm is installed here (tests/vllm/test_bad_input.py checks this case by hiding it)",
)
def test_importing_the_vllm_bridge_without_vllm_names_the_package_and_the_fix() -> None:
    """MissingExtraError (an ImportError and an AttnDIError) naming vllm and how to install
    it; `import attn_di` itself never needed vLLM."""
    result = subprocess.run(
        [sys.executable, "-c", "import attn_di.integrations.vllm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-2:]
    assert last[0] == (
        "attn_di.exceptions.MissingExtraError: attn_di.integrations.vllm needs the optional "
        "dependency 'vllm', which is not installed"
    )
    assert last[1].startswith("Hint: vLLM (0.32 or later) goes in an environment of its own")
    assert "bash scripts/setup-vllm.sh" in last[1]
    assert "docs/guides/vllm.md" in last[1]
    assert issubclass(attn_di.exceptions.MissingExtraError, ImportError)
