"""A plain float64 reference of paged attention, for checks (needs torch).

It follows the definition, not any backend: for every sequence and head,
``softmax(q k^T * scale + mask) v`` over the keys/values of all its positions, gathered from
the paged KV cache through the block table, with the query tokens at the sequence's last
``query_len`` positions and a causal mask on absolute positions. Slow by design; used by
``attn-di run`` and by the example engine's reference path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from attn_di.backend import AttentionMetadata

__all__ = ["reference_attention"]


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention in float64, reading cached positions from ``kv_cache`` and new ones from key/value.

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the query tokens' own K/V
            (they take precedence over whatever the cache holds at their slots).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (not modified).
        metadata: the batch (query_start_loc, seq_lens, block_table, causal).
        scale: the factor applied to ``q k^T``.

    Returns:
        ``[num_tokens, num_heads * head_size]`` float64.
    """
    import torch

    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    block_size = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    output = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    starts = metadata.query_start_loc.tolist()
    for index, seq_len in enumerate(metadata.seq_lens.tolist()):
        begin, end = starts[index], starts[index + 1]
        query_len = end - begin
        if query_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = metadata.block_table[index, positions // block_size].long()
        offsets = positions % block_size
        keys = kv_cache[0, blocks, offsets].to(torch.float64)  # [seq_len, kv_heads, head_size]
        values = kv_cache[1, blocks, offsets].to(torch.float64)
        keys[seq_len - query_len :] = key[begin:end].to(torch.float64)
        values[seq_len - query_len :] = value[begin:end].to(torch.float64)
        keys = keys.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        q = query[begin:end].to(torch.float64)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if metadata.causal:
            query_positions = positions[seq_len - query_len :]
            hidden = positions[None, :] > query_positions[:, None]
            scores = scores.masked_fill(hidden[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        output[begin:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return output.reshape(num_tokens, num_heads * head_size)
