"""Shared fixtures of the backend tests."""

from __future__ import annotations

import pytest
import torch

from attn_di.backend import AttentionBackend
from attn_di.backends.cpu_attn import CPUAttentionBackend
from attn_di.backends.flex_attention import FlexAttentionBackend
from attn_di.backends.torch_sdpa import TorchSDPABackend

COMPUTING_BACKENDS: list[type[AttentionBackend]] = [
    CPUAttentionBackend,
    TorchSDPABackend,
    FlexAttentionBackend,
]


@pytest.fixture(name="backend_cls", params=COMPUTING_BACKENDS, ids=lambda b: b.get_name())
def _backend_cls(request: pytest.FixtureRequest) -> type[AttentionBackend]:
    """Each backend that computes attention."""
    backend_cls: type[AttentionBackend] = request.param
    return backend_cls


@pytest.fixture(autouse=True, name="_seed")
def _seed() -> None:
    """Every test starts from the same torch seed."""
    torch.manual_seed(0)
