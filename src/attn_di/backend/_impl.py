"""The attention impl interface: constructor options, feature checks and ``forward``."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from attn_di.backend._types import AttentionType
from attn_di.exceptions import InvalidInputError, UnsupportedFeatureError

if TYPE_CHECKING:
    import torch

    from attn_di.backend._backend import AttentionBackend
    from attn_di.backend._metadata import AttentionMetadata

__all__ = ["AttentionImpl"]

# Which of attn_di's backends implement each optional feature (used in hints only).
_FEATURE_PROVIDERS: dict[str, tuple[str, ...]] = {
    "alibi_slopes": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
    "sliding_window": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
    "logits_soft_cap": ("CPU_ATTN", "FLEX_ATTENTION"),
    "sinks": ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"),
}


class AttentionImpl(abc.ABC):
    """One attention layer's computation for a backend (vLLM's ``AttentionImpl``).

    The constructor checks the options against what the backend declares and refuses any
    feature it cannot honour with :class:`~attn_di.exceptions.UnsupportedFeatureError`
    (a ``NotImplementedError`` naming the feature), as vLLM's impls do.

    Args:
        num_heads: query heads H.
        head_size: D, features per head.
        scale: the factor applied to ``q @ k^T`` (usually ``D ** -0.5``).
        num_kv_heads: key/value heads; defaults to H; must divide H (GQA/MQA).
        alibi_slopes: ``[H]`` ALiBi slopes m_h; the score of query position i and key
            position j gets ``m_h * (j - i)`` added (Press et al. 2022, "Train Short,
            Test Long").
        sliding_window: w; position p sees keys k with ``p - w < k <= p``.
        kv_cache_dtype: the cache dtype string; only ``"auto"`` (the model dtype).
        logits_soft_cap: c; scores s become ``c * tanh(s / c)`` (Gemma 2). None or 0: off.
        attn_type: an :class:`AttentionType` or its string.
        sinks: ``[H]`` per-head logits that join the softmax denominator and carry no
            value (gpt-oss attention sinks).
        kv_sharing_target_layer_name: another layer whose cache this one reads; not
            supported (keyword only, as vLLM passes it).

    Raises:
        InvalidInputError: a non-positive size, num_kv_heads not dividing num_heads, or
            alibi_slopes/sinks of the wrong length.
        UnsupportedFeatureError: a feature or attention type the backend does not implement.
    """

    backend: ClassVar[type[AttentionBackend]]
    supports_alibi: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: Sequence[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        sinks: torch.Tensor | None = None,
        *,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        name = self.backend.get_name()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for argument, value in (
            ("num_heads", num_heads),
            ("head_size", head_size),
            ("num_kv_heads", num_kv_heads),
        ):
            if value <= 0:
                raise InvalidInputError(argument, f"must be positive, got {value}")
        if num_heads % num_kv_heads:
            raise InvalidInputError(
                "num_kv_heads",
                f"{num_kv_heads} does not divide num_heads {num_heads}",
                hint="GQA/MQA needs num_heads to be a multiple of num_kv_heads",
            )
        try:
            attn_type = AttentionType(attn_type)
        except ValueError:
            raise InvalidInputError(
                "attn_type",
                f"unknown attention type {attn_type!r}",
                hint=f"one of {', '.join(t.value for t in AttentionType)}",
            ) from None
        if not self.backend.supports_attn_type(attn_type):
            raise UnsupportedFeatureError(name, f"attention type {attn_type.value}")
        if kv_cache_dtype not in self.backend.supported_kv_cache_dtypes:
            raise UnsupportedFeatureError(name, f"kv_cache_dtype {kv_cache_dtype!r}")
        if kv_sharing_target_layer_name is not None:
            raise UnsupportedFeatureError(name, "kv_sharing_target_layer_name")
        if sliding_window is not None and sliding_window <= 0:
            raise InvalidInputError("sliding_window", f"must be positive, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise InvalidInputError("logits_soft_cap", f"must be >= 0, got {logits_soft_cap}")
        slopes = None if alibi_slopes is None else [float(m) for m in alibi_slopes]
        self._require(slopes is not None, self.supports_alibi, "alibi_slopes")
        self._require(sliding_window is not None, self.supports_sliding_window, "sliding_window")
        self._require(bool(logits_soft_cap), self.supports_logits_soft_cap, "logits_soft_cap")
        self._require(sinks is not None, self.backend.supports_sink(), "sinks")
        if slopes is not None and len(slopes) != num_heads:
            raise InvalidInputError(
                "alibi_slopes", f"has {len(slopes)} entries, expected num_heads={num_heads}"
            )
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise InvalidInputError(
                "sinks", f"shape {tuple(sinks.shape)} should be [num_heads]=[{num_heads}]"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.alibi_slopes = slopes
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.sinks = sinks

    def _require(self, requested: bool, supported: bool, feature: str) -> None:
        if requested and not supported:
            raise UnsupportedFeatureError(
                self.backend.get_name(), feature, _FEATURE_PROVIDERS.get(feature, ())
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, head_size={self.head_size}, "
            f"num_kv_heads={self.num_kv_heads}, attn_type={self.attn_type.value!r})"
        )

    @abc.abstractmethod
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
        """Write the new keys/values into the cache, then attend.

        Args:
            layer: the calling layer (unused by attn_di's backends; may be None).
            query: ``[N, H, D]``.
            key: ``[N, H_kv, D]``, same dtype as query.
            value: ``[N, H_kv, D]``, same dtype as query.
            kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` (see
                :meth:`AttentionBackend.get_kv_cache_shape`); may be empty for
                ``encoder_only``.
            attn_metadata: the batch's :class:`AttentionMetadata`.
            output: optional ``[N, H * D]`` buffer to write into.

        Returns:
            ``[N, H * D]`` in the query's dtype (``output`` itself when given).

        Raises:
            InvalidInputError: a tensor of the wrong shape, dtype or device, or a slot or
                block number outside the cache.
        """
