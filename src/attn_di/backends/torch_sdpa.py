"""TORCH_SDPA: ``torch.nn.functional.scaled_dot_product_attention`` over the paged cache.

Keys and values are gathered from the cache into padded ``[b, H_kv, Lk, D]`` tensors and
passed to SDPA with a mask built from the metadata. SDPA takes a boolean or additive mask
but no score function, so ALiBi and sinks are expressed as additive masks and logits soft
capping is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812

from attn_di.backend._backend import AttentionBackend
from attn_di.backend._impl import AttentionImpl
from attn_di.backend._metadata import AttentionMetadata
from attn_di.backend._types import AttentionType
from attn_di.backends._common import (
    BatchPlan,
    SeqGroup,
    alibi_bias,
    check_inputs,
    new_output,
    uses_cache,
    write_kv_cache,
)

__all__ = ["TorchSDPABackend", "TorchSDPAImpl"]


class TorchSDPABackend(AttentionBackend):
    """Paged attention through torch's fused SDPA kernel.

    Supports fp32/bf16/fp16, any head or block size, GQA/MQA, sliding window, ALiBi and
    sinks (as additive masks); decoder, encoder and encoder-only attention. Refuses
    ``logits_soft_cap`` (SDPA has no score modifier).
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_attn_types: ClassVar[tuple[str, ...]] = (
        AttentionType.DECODER,
        AttentionType.ENCODER,
        AttentionType.ENCODER_ONLY,
    )
    supports_backward: ClassVar[bool] = True
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @staticmethod
    def get_name() -> str:
        """``"TORCH_SDPA"``."""
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[TorchSDPAImpl]:
        """:class:`TorchSDPAImpl`."""
        return TorchSDPAImpl

    @classmethod
    def supports_sink(cls) -> bool:
        """True: a sink is an extra zero key/value whose mask entry is the sink logit."""
        return True


class TorchSDPAImpl(AttentionImpl):
    """The TORCH_SDPA computation; see :class:`~attn_di.backend.AttentionImpl` for arguments."""

    backend: ClassVar[type[AttentionBackend]] = TorchSDPABackend
    supports_alibi: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

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
        """Write keys/values into ``kv_cache``, then attend; see :meth:`AttentionImpl.forward`."""
        check_inputs(self, query, key, value, kv_cache, attn_metadata, output)
        result = new_output(query, output)
        actual = attn_metadata.num_actual_tokens
        if uses_cache(self):
            write_kv_cache(key[:actual], value[:actual], kv_cache, attn_metadata.slot_mapping)
            flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
            key_src, value_src = flat[0], flat[1]
            block_size = int(kv_cache.shape[2])
        else:
            key_src, value_src, block_size = key, value, 1
        rows = result.view(-1, self.num_heads, self.head_size)
        for group in BatchPlan(self, attn_metadata, block_size).groups():
            attended = self._attend(query, key_src, value_src, group)  # [b, H, Lq, D]
            attended = attended.transpose(1, 2)[group.query_valid]
            rows[group.query_index[group.query_valid]] = attended.to(result.dtype)
        return result

    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, H, Lq, D]`` attention of one group, in the query's dtype."""
        seqs = int(group.kv_index.shape[0])
        queries = query[group.query_index].transpose(1, 2)  # [b, H, Lq, D]
        keys = key_src[group.kv_index].transpose(1, 2)  # [b, H_kv, Lk, D]
        values = value_src[group.kv_index].transpose(1, 2)
        mask: torch.Tensor = group.allowed[:, None]  # [b, 1, Lq, Lk]
        # Padding query rows see no key; SDPA would return NaN there, so let them see all
        # keys (their output is discarded).
        mask = mask | ~group.query_valid[:, None, :, None]
        if self.alibi_slopes is not None or self.sinks is not None:
            additive = torch.zeros(mask.shape, dtype=torch.float32, device=query.device)
            additive = additive.masked_fill(~mask, float("-inf"))
            if self.alibi_slopes is not None:
                additive = additive + alibi_bias(self.alibi_slopes, group)
            if self.sinks is not None:
                # A sink is one more key with zero key and value whose score is its logit:
                # it joins the softmax denominator and adds nothing to the output.
                heads, q_len = self.num_heads, int(queries.shape[2])
                sink_logit = self.sinks.float().view(1, heads, 1, 1)
                sink_col = sink_logit.expand(seqs, heads, q_len, 1)
                additive = torch.cat([additive.expand(seqs, heads, q_len, -1), sink_col], -1)
                zero = keys.new_zeros((seqs, self.num_kv_heads, 1, self.head_size))
                keys = torch.cat([keys, zero], dim=2)
                values = torch.cat([values, zero], dim=2)
            mask = additive.to(query.dtype)
        return F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
