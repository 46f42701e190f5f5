"""Bad input is one typed error at engine start-up, naming the member, the reason and the fix.

The check runs where the engine is started (``EngineArgs.create_engine_config``), before any
worker process exists, so the multiprocess engine raises the same error as the in-process one
instead of a traceback from its worker. None of these starts a worker, so they are quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    register_backend,
)

import attn_di
from attn_di.exceptions import BackendImportError, BackendRejectedError
from tests.vllm.conftest import CPU_ATTN_PATH, REPO, engine

MODES = pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])


@MODES
def test_a_registered_path_that_does_not_import(smollm2: Path, multiprocess: bool) -> None:
    """BackendImportError naming CPU_ATTN, the path, why, and how to fix it."""
    register_backend(AttentionBackendEnum.CPU_ATTN, "my_attention_pkg.backends.FastBackend")
    with pytest.raises(BackendImportError) as caught, engine(smollm2, multiprocess=multiprocess):
        pass
    error = caught.value
    assert (error.member, error.class_path, error.reason) == (
        "CPU_ATTN",
        "my_attention_pkg.backends.FastBackend",
        BackendImportError.MODULE_NOT_FOUND,
    )
    text = str(error)
    assert (
        "cannot import attention backend CPU_ATTN from 'my_attention_pkg.backends.FastBackend'"
        in text
    )
    assert "Hint: install the package that provides it, or register another class" in text


@MODES
def test_an_attn_di_backend_refusing_the_model(smollm2: Path, multiprocess: bool) -> None:
    """BackendRejectedError naming CPU_ATTN, attn_di's reason and the fix, for an fp8 cache."""
    attn_di.register_backend(attn_di.AttentionBackendEnum.CPU_ATTN, CPU_ATTN_PATH)
    with (
        pytest.raises(BackendRejectedError) as caught,
        engine(smollm2, multiprocess=multiprocess, kv_cache_dtype="fp8"),
    ):
        pass
    error = caught.value
    assert error.member == "CPU_ATTN"
    assert error.reasons == ["kv_cache_dtype not supported"]
    assert "the engine's start-up check" in error.origin
    assert "Hint: use kv_cache_dtype='auto'" in str(error)


def test_the_bridge_without_vllm() -> None:
    """Importing attn_di.integrations.vllm where vLLM is missing raises MissingExtraError
    (an ImportError) naming the package and how to install it."""
    script = textwrap.dedent(
        """
        import sys
        class NoVllm:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoVllm())
        from attn_di.exceptions import MissingExtraError
        try:
            import attn_di.integrations.vllm
        except MissingExtraError as error:
            print(type(error).__mro__[1:3], error.extra)
            print(error)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "AttnDIError" in result.stdout
    assert "ImportError" in result.stdout
    assert "attn_di.integrations.vllm needs the optional dependency 'vllm'" in result.stdout
    assert "Hint: vLLM (0.32 or later) goes in an environment of its own" in result.stdout
    assert "docs/guides/vllm.md" in result.stdout
