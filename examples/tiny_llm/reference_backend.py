"""The float64 reference path: a backend whose impl is attn_di's plain reference attention.

Run the engine with ``ModelConfig(dtype="float64")`` and this backend to get the tokens every
real backend must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch

from attn_di.backend import AttentionMetadataBuilder
from attn_di.reference import reference_attention


class ReferenceImpl:
    """Writes the new K/V at their slots, then attends with the float64 reference."""

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None
    ) -> None:
        self.scale = scale

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        slots = attn_metadata.slot_mapping
        valid = slots >= 0
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0, slots[valid]] = key[valid]
        flat[1, slots[valid]] = value[valid]
        result = reference_attention(query, key, value, kv_cache, attn_metadata, self.scale)
        return result.to(query.dtype)


class ReferenceBackend:
    """vLLM-shaped backend class for the reference path (any dtype, any size)."""

    @staticmethod
    def get_name() -> str:
        return "REFERENCE"

    @staticmethod
    def get_impl_cls() -> type[ReferenceImpl]:
        return ReferenceImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return AttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        return []
