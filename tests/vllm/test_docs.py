"""docs/guides/vllm.md as tested code: every ```python vllm block runs as written, in .venv-vllm.

A block runs as a script in a fresh process (``MODEL`` names the SmolLM2 folder); one whose info
string says ``runner:PytestRunner`` is a test module pytest runs (it must pass); one that says
``server`` runs while the guide's own server command (its ```bash block that starts
``vllm.entrypoints.openai.api_server``) serves on a free port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm run in .venv-vllm)")

from markdown_it import MarkdownIt

from tests.vllm.conftest import REPO, free_port, serving

GUIDE = REPO / "docs" / "guides" / "vllm.md"
PORT_IN_GUIDE = "8000"
TIMEOUT_S = 600


def _fences() -> list[tuple[str, str]]:
    """``(info string, code)`` of every fenced block of the guide."""
    tokens = MarkdownIt("commonmark").parse(GUIDE.read_text())
    return [(t.info.strip(), t.content) for t in tokens if t.type == "fence"]


BLOCKS = [
    (info, code)
    for info, code in _fences()
    if info.split()[:1] == ["python"] and "vllm" in info.split()
]


def _environment(tmp_path: Path, model: Path) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}  # vLLM divides by
    return {  # tqdm's elapsed time, which a disabled bar leaves at 0
        **inherited,
        "MODEL": str(model),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",  # vLLM's default (the guide quotes an INFO line)
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(tmp_path),
    }


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(name="guide_server")
def _guide_server(tmp_path: Path, smollm2: Path) -> Iterator[str]:
    """The guide's server command, run as written (on a free port); yields the port."""
    commands = [code for info, code in _fences() if info == "bash" and "api_server" in code]
    assert len(commands) == 1
    port = str(free_port())
    script = commands[0].replace(PORT_IN_GUIDE, port).replace("python -m", f"{sys.executable} -m")
    log = tmp_path / "server.log"
    command = ["bash", "-c", f"exec env {script.strip()}"]  # exec: the PID is the server's
    with serving(command, _environment(tmp_path, smollm2), log, int(port), timeout_s=240):
        yield port
        assert "attn_di: vLLM's CPU_ATTN resolves to" in log.read_text()


def test_the_guide_has_its_blocks() -> None:
    """Python blocks of every kind are there (none silently dropped by a fence typo)."""
    kinds = [info.split()[2:] for info, _ in BLOCKS]
    assert len(BLOCKS) >= 4
    assert ["runner:PytestRunner"] in kinds
    assert ["server"] in kinds
    python_fences = [info for info, _ in _fences() if info.split()[:1] == ["python"]]
    assert len(python_fences) == len(BLOCKS)  # every Python block of the guide needs vLLM


@pytest.mark.parametrize(("info", "code"), BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_python_block_runs(
    info: str, code: str, tmp_path: Path, smollm2: Path, request: pytest.FixtureRequest
) -> None:
    """The block, run as the module docstring says, exits 0 (a test module: it passes)."""
    env = _environment(tmp_path, smollm2)
    if "server" in info.split():
        port = request.getfixturevalue("guide_server")
        code = code.replace(PORT_IN_GUIDE, port)
    if "runner:PytestRunner" in info.split():
        path = tmp_path / "test_block.py"
        path.write_text(code)
        result = _run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
            tmp_path,
            env,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        return
    path = tmp_path / "block.py"
    path.write_text(code)
    result = _run([sys.executable, str(path)], tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    if "capital of France" in code and "print(" in code:
        assert "Paris" in result.stdout
