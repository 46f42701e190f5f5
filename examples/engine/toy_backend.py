"""A dependency-free attention backend for the example engine (pure Python, one head).

It computes softmax(q . k * scale) v over a list-based KV cache: enough to show a real
backend class being resolved, injected and swapped. attn_di's torch backends
(``AttentionBackendEnum.CPU_ATTN`` ...) are the ones to use for real tensors.
"""

from __future__ import annotations

import math


class ToyAttentionImpl:
    """Single-head causal attention over a growing list-based KV cache.

    Args:
        head_size: length of every query/key/value vector.
        scale: multiplies q . k; usually ``head_size ** -0.5``.
    """

    def __init__(self, head_size: int, scale: float) -> None:
        self.head_size = head_size
        self.scale = scale

    def forward(
        self,
        query: list[float],
        key: list[float],
        value: list[float],
        kv_cache: list[tuple[list[float], list[float]]],
    ) -> list[float]:
        """Append (key, value) to ``kv_cache``, then attend ``query`` over the whole cache.

        Returns:
            The attention output, a list of ``head_size`` floats.
        """
        kv_cache.append((key, value))
        scores = [
            self.scale * sum(q * k for q, k in zip(query, cached_key, strict=True))
            for cached_key, _ in kv_cache
        ]
        top = max(scores)
        weights = [math.exp(score - top) for score in scores]
        total = sum(weights)
        return [
            sum(w * cached_value[d] for w, (_, cached_value) in zip(weights, kv_cache, strict=True))
            / total
            for d in range(self.head_size)
        ]


class ToyBackend:
    """The backend class: names itself and hands out its impl class (as vLLM's do)."""

    @staticmethod
    def get_name() -> str:
        return "TOY"

    @staticmethod
    def get_impl_cls() -> type[ToyAttentionImpl]:
        return ToyAttentionImpl


class UniformAttentionImpl(ToyAttentionImpl):
    """Attends uniformly (scores ignored): a visibly different implementation to swap in."""

    def forward(
        self,
        query: list[float],
        key: list[float],
        value: list[float],
        kv_cache: list[tuple[list[float], list[float]]],
    ) -> list[float]:
        kv_cache.append((key, value))
        return [sum(v[d] for _, v in kv_cache) / len(kv_cache) for d in range(self.head_size)]


class UniformBackend(ToyBackend):
    """A second backend, registered or overridden in place of :class:`ToyBackend`."""

    @staticmethod
    def get_name() -> str:
        return "UNIFORM"

    @staticmethod
    def get_impl_cls() -> type[ToyAttentionImpl]:
        return UniformAttentionImpl
