"""The vLLM blocks of the docs as tested code: every ```python vllm block of docs/guides/vllm.md
and of the tutorial docs/tutorials/your-own-backend.md runs as written, in .venv-vllm.

A block runs as a script in a fresh process (``MODEL`` names the SmolLM2 folder), in a folder
that holds its page's ``file:NAME`` blocks (the tutorial's ``my_attention.py``); one whose info
string says ``runner:PytestRunner`` is a test module pytest runs (it must pass); one that says
``server`` runs while the guide's own server command (its ```bash block that starts
``vllm.entrypoints.openai.api_server``) serves on a free port. No block's run converts the
model's weights to another dtype (vLLM's "Attempted to load weight" warnings).
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
TUTORIAL = REPO / "docs" / "tutorials" / "your-own-backend.md"
PAGES = [GUIDE, TUTORIAL]
PORT_IN_GUIDE = "8000"
TIMEOUT_S = 600
#: vLLM's warning for each weight it converts to the engine's dtype (122 lines for SmolLM2
#: in float32 run as bfloat16): the docs' models are written in the dtype vLLM runs them in.
DTYPE_WARNING = "Attempted to load weight"


def _fences(page: Path = GUIDE) -> list[tuple[str, str]]:
    """``(info string, code)`` of every fenced block of ``page``."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [(t.info.strip(), t.content) for t in tokens if t.type == "fence"]


def _vllm_blocks(page: Path) -> list[tuple[str, str]]:
    return [
        (info, code)
        for info, code in _fences(page)
        if info.split()[:1] == ["python"] and "vllm" in info.split()
    ]


BLOCKS = _vllm_blocks(GUIDE)
ALL_BLOCKS = [(page, info, code) for page in PAGES for info, code in _vllm_blocks(page)]


def _write_page_files(page: Path, folder: Path) -> None:
    """Write each ``file:NAME`` block of ``page`` into ``folder`` under its name."""
    for info, code in _fences(page):
        for word in info.split():
            if word.startswith("file:"):
                (folder / word.removeprefix("file:")).write_text(code)


def _environment(tmp_path: Path, model: Path) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}  # vLLM divides by
    return {  # tqdm's elapsed time, which a disabled bar leaves at 0
        **inherited,
        "MODEL": str(model),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",  # vLLM's default (the guide quotes an INFO line)
        # this checkout's attn_di first (the venv's editable install may be another's)
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
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
    assert DTYPE_WARNING not in log.read_text()


def test_the_guide_has_its_blocks() -> None:
    """Python blocks of every kind are there (none silently dropped by a fence typo)."""
    kinds = [info.split()[2:] for info, _ in BLOCKS]
    assert len(BLOCKS) >= 4
    assert ["runner:PytestRunner"] in kinds
    assert ["server"] in kinds
    python_fences = [info for info, _ in _fences() if info.split()[:1] == ["python"]]
    assert len(python_fences) == len(BLOCKS)  # every Python block of the guide needs vLLM
    tutorial = _vllm_blocks(TUTORIAL)  # its last section: the tutorial's backend in vLLM
    assert len(tutorial) == 1
    assert "tensor_parallel_size=2" in tutorial[0][1]


def _block_id(page: Path, index: int) -> str:
    return f"{page.parent.name}/{page.stem}-block{index}"


@pytest.mark.parametrize(
    ("page", "info", "code"),
    ALL_BLOCKS,
    ids=[
        _block_id(page, sum(1 for p, _, _ in ALL_BLOCKS[:i] if p == page))
        for i, (page, _, _) in enumerate(ALL_BLOCKS)
    ],
)
def test_every_python_block_runs(
    page: Path,
    info: str,
    code: str,
    tmp_path: Path,
    smollm2: Path,
    request: pytest.FixtureRequest,
) -> None:
    """The block, run as the module docstring says, exits 0 (a test module: it passes), and
    vLLM converted no weight's dtype."""
    env = _environment(tmp_path, smollm2)
    _write_page_files(page, tmp_path)
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
    name = next((w.removeprefix("file:") for w in info.split() if w.startswith("file:")), None)
    path = tmp_path / (name or "block.py")
    path.write_text(code)
    result = _run([sys.executable, str(path)], tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert DTYPE_WARNING not in result.stdout + result.stderr
    if "capital of France" in code and "print(" in code:
        assert "Paris" in result.stdout
