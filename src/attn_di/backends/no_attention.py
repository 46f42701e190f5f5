"""NO_ATTENTION: the backend of attention-free models (e.g. pure state-space models).

It allocates an empty KV cache and has no computation: calling ``forward`` raises.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attn_di.backend._backend import AttentionBackend
from attn_di.backend._impl import AttentionImpl
from attn_di.backend._metadata import AttentionMetadata
from attn_di.backend._types import AttentionType
from attn_di.exceptions import UnsupportedFeatureError

__all__ = ["NoAttentionBackend", "NoAttentionImpl"]


class NoAttentionBackend(AttentionBackend):
    """A placeholder backend for models without attention layers.

    Its KV cache has zero blocks, so it costs no memory; any dtype, head size, block size
    and attention type validates, since nothing is computed.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_attn_types: ClassVar[tuple[str, ...]] = tuple(AttentionType)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @staticmethod
    def get_name() -> str:
        """``"NO_ATTENTION"``."""
        return "NO_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type[NoAttentionImpl]:
        """:class:`NoAttentionImpl`."""
        return NoAttentionImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, 0, block_size, num_kv_heads, head_size)``: the usual layout with no blocks."""
        return (2, 0, block_size, num_kv_heads, head_size)


class NoAttentionImpl(AttentionImpl):
    """An impl that exists so that layers can be built; it refuses to run."""

    backend: ClassVar[type[AttentionBackend]] = NoAttentionBackend

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Always raises: an attention-free model must not call attention.

        Raises:
            UnsupportedFeatureError: always (a ``NotImplementedError``).
        """
        error = UnsupportedFeatureError(
            "NO_ATTENTION", "forward (it is the backend of attention-free models)"
        )
        error.hint = "select a computing backend such as CPU_ATTN for models with attention"
        raise error
