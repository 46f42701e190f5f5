"""TORCH_SDPA: ``torch.nn.functional.scaled_dot_product_attention`` over the paged cache.

Keys and values are gathered from the cache into padded ``[b, H_kv, Lk, D]`` tensors and
passed to SDPA with a mask built from the metadata. SDPA takes a boolean or additive mask
but no score function, so ALiBi and sinks are expressed as additive masks and logits soft
capping is refused.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812

from attn_di.backend._backend import AttentionBackend
from attn_di.backends._common import (
    SeqGroup,
    alibi_bias,
)
from attn_di.backends._grouped import GroupedAttentionImpl, TorchCPUBackend

__all__ = ["TorchSDPABackend", "TorchSDPAImpl"]


class TorchSDPABackend(TorchCPUBackend):
    """Paged attention through torch's fused SDPA kernel.

    Supports fp32/bf16/fp16, any head or block size, GQA/MQA, sliding window, ALiBi and
    sinks (as additive masks); decoder, encoder and encoder-only attention. Refuses
    ``logits_soft_cap`` (SDPA has no score modifier).
    """

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


class TorchSDPAImpl(GroupedAttentionImpl):
    """The TORCH_SDPA computation; see :class:`~attn_di.backend.AttentionImpl` for arguments."""

    backend: ClassVar[type[AttentionBackend]] = TorchSDPABackend
    supports_alibi: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, H, Lq, D]`` attention of one group, in the query's dtype.

        GQA is folded into the query axis (the g query heads of a KV head become g * Lq
        rows, each with its query's mask row), which is exact and lets SDPA take its fused
        CPU path instead of expanding K/V.
        """
        seqs, q_len = (int(n) for n in group.query_index.shape)
        kv_heads, per_kv, size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        rows = per_kv * q_len
        queries = query[group.query_index].view(seqs, q_len, kv_heads, per_kv, size)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(seqs, kv_heads, rows, size)
        keys = key_src[group.kv_index].transpose(1, 2)  # [b, H_kv, Lk, D]
        values = value_src[group.kv_index].transpose(1, 2)
        k_len = int(keys.shape[2])
        # Padding query rows see no key; SDPA would return NaN there, so let them see all
        # keys (their output is discarded).
        allowed = group.allowed | ~group.query_valid[:, :, None]  # [b, Lq, Lk]
        mask = allowed[:, None, None].expand(seqs, 1, per_kv, q_len, k_len)
        mask = mask.reshape(seqs, 1, rows, k_len)
        if self.alibi_slopes is not None or self.sinks is not None:
            additive = torch.zeros(mask.shape, dtype=torch.float32, device=query.device)
            additive = additive.masked_fill(~mask, float("-inf"))
            if self.alibi_slopes is not None:
                bias = alibi_bias(self.alibi_slopes, group)  # [b, H, Lq, Lk]
                additive = additive + bias.reshape(seqs, kv_heads, rows, k_len)
            if self.sinks is not None:
                # A sink is one more key with zero key and value whose score is its logit:
                # it joins the softmax denominator and adds nothing to the output.
                sink_logit = self.sinks.float().view(1, kv_heads, per_kv, 1, 1)
                sink_col = sink_logit.expand(seqs, kv_heads, per_kv, q_len, 1)
                additive = additive.expand(seqs, kv_heads, rows, k_len)
                additive = torch.cat([additive, sink_col.reshape(seqs, kv_heads, rows, 1)], -1)
                zero = keys.new_zeros((seqs, kv_heads, 1, size))
                keys = torch.cat([keys, zero], dim=2)
                values = torch.cat([values, zero], dim=2)
            # Kept float32 (SDPA adds it to its float32 scores): in bfloat16 an ALiBi bias
            # of ~30 (slope 0.23 over 137 positions) rounds in steps of 0.125, which moved a
            # bfloat16 output by 0.084 against the float64 reference.
            mask = additive
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale
        )  # [b, H_kv, g * Lq, D]
        return attended.view(seqs, kv_heads, per_kv, q_len, size).reshape(
            seqs, self.num_heads, q_len, size
        )
