"""A small decoder-only transformer whose attention runs through an injected backend's impl.

Embedding -> N x [RMSNorm -> GQA attention with rotary positions -> RMSNorm -> gated MLP] ->
RMSNorm -> LM head. Weights are random but seeded (and scaled so logits are well separated),
so a given seed always generates the same tokens: the engine's tests compare backends on it.
Formulas: RMSNorm (Zhang & Sennrich 2019), rotary embeddings (Su et al. 2021, "RoFormer",
the rotate-half layout used by GPT-NeoX and vLLM), SiLU-gated MLP (Shazeer 2020).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny model and its paged KV cache.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        hidden_size: the residual stream width (``num_heads * head_size``).
        num_layers: decoder layers, each with its own KV cache.
        num_heads, num_kv_heads: query and key/value heads (GQA when they differ).
        head_size: features per head.
        intermediate_size: MLP width.
        block_size: tokens per KV-cache block; num_blocks: blocks per layer cache.
        dtype: "float32", "bfloat16", "float16" or "float64" (the reference path).
        seed: the weights' seed.
    """

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    block_size: int = 16
    num_blocks: int = 128
    dtype: str = "float32"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_size]`` by its absolute ``positions`` ``[tokens]``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = angles.cos().to(x.dtype)[:, None, :]
    sin = angles.sin().to(x.dtype)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class DecoderLayer(torch.nn.Module):
    """One pre-norm decoder layer; attention is delegated to ``impl`` (a backend's impl)."""

    def __init__(self, config: ModelConfig, impl: Any) -> None:
        super().__init__()
        self.config = config
        self.impl = impl
        hidden, head = config.hidden_size, config.head_size
        self.q_proj = torch.nn.Linear(hidden, config.num_heads * head, bias=False)
        self.k_proj = torch.nn.Linear(hidden, config.num_kv_heads * head, bias=False)
        self.v_proj = torch.nn.Linear(hidden, config.num_kv_heads * head, bias=False)
        self.o_proj = torch.nn.Linear(config.num_heads * head, hidden, bias=False)
        self.gate_proj = torch.nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, hidden, bias=False)
        self.attn_norm = RMSNorm(hidden, config.rms_eps)
        self.mlp_norm = RMSNorm(hidden, config.rms_eps)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        config = self.config
        x = self.attn_norm(hidden)
        q = self.q_proj(x).view(-1, config.num_heads, config.head_size)
        k = self.k_proj(x).view(-1, config.num_kv_heads, config.head_size)
        v = self.v_proj(x).view(-1, config.num_kv_heads, config.head_size)
        q = rotary(q, positions, config.rope_theta)
        k = rotary(k, positions, config.rope_theta)
        attended: torch.Tensor = self.impl.forward(None, q, k, v, kv_cache, metadata)
        hidden = hidden + self.o_proj(attended)
        x = self.mlp_norm(hidden)
        gated = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        mlp_out: torch.Tensor = self.down_proj(gated)
        return hidden + mlp_out


class TinyDecoder(torch.nn.Module):
    """The whole model: ``forward(token_ids, positions, kv_caches, metadata) -> logits``.

    Args:
        config: sizes, dtype and seed.
        impls: one attention impl per layer.
    """

    def __init__(self, config: ModelConfig, impls: list[Any]) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, impl) for impl in impls)
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            for name, parameter in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    continue
                fan_in = parameter.shape[-1] if name != "embed.weight" else 1
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
        self.to(config.torch_dtype)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:
        """Logits ``[tokens, vocab_size]`` for ``token_ids`` ``[tokens]`` at ``positions``."""
        hidden = self.embed(token_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, kv_cache, metadata)
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits
