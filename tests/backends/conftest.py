"""Shared fixtures of the backend tests."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from attn_di.backend import AttentionBackend
from attn_di.backends import _cpu_kernel
from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from attn_di.backends.flex_attention import FlexAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend

COMPUTING_BACKENDS: list[type[AttentionBackend]] = [
    CPUAttentionBackend,
    TorchSDPABackend,
    FlexAttentionBackend,
]


# CPU_ATTN runs twice: on its compiled kernel and on its pure-torch path.
_BACKEND_PATHS = [
    (CPUAttentionBackend, "kernel"),
    (CPUAttentionBackend, "torch"),
    *((backend_cls, None) for backend_cls in COMPUTING_BACKENDS[1:]),
]


def _path_id(param: tuple[type[AttentionBackend], str | None]) -> str:
    backend_cls, path = param
    return backend_cls.get_name() + (f"-{path}" if path else "")


@pytest.fixture(name="backend_cls", params=_BACKEND_PATHS, ids=_path_id)
def _backend_cls(request: pytest.FixtureRequest) -> Iterator[type[AttentionBackend]]:
    """Each backend that computes attention (CPU_ATTN on each of its two paths)."""
    backend_cls, path = request.param
    if path == "torch":
        with _cpu_kernel.pure_torch():
            yield backend_cls
        return
    if path == "kernel" and not _cpu_kernel.kernel_status().active:
        pytest.skip(f"CPU_ATTN's kernel: {_cpu_kernel.kernel_status().describe()}")
    yield backend_cls


@pytest.fixture(name="kernel")
def _kernel() -> None:
    """Skips the test where CPU_ATTN's kernel is unavailable (loaded once per session)."""
    status = _cpu_kernel.kernel_status()
    if not status.active:
        pytest.skip(f"CPU_ATTN's kernel: {status.describe()}")


@pytest.fixture(autouse=True, scope="session", name="_kernel_loaded")
def _kernel_loaded() -> None:
    """Load (or build) CPU_ATTN's kernel once, before any test, so that its one fallback
    warning, where it cannot be built, does not fail whichever test happens to come first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _cpu_kernel.kernel_status()


@pytest.fixture(autouse=True, name="_seed")
def _seed() -> None:
    """Every test starts from the same torch seed."""
    torch.manual_seed(0)


@pytest.fixture(name="kernel_calls")
def _kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of CPU_ATTN's compiled path (one entry per call)."""
    calls: list[int] = []
    original = CPUAttentionImpl._run_kernel

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CPUAttentionImpl, "_run_kernel", counted)
    return calls
