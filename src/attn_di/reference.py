"""A plain reference of paged attention, in float64, for checks (needs torch).

It follows the definition, not any backend: for every sequence and head,
``softmax(q k^T * scale + mask) v`` (Vaswani et al. 2017) over the keys/values of all its
positions, gathered from the paged KV cache through the block table, with the query tokens
at the sequence's last ``query_len`` positions. The layer options of
:class:`~attn_di.backend.AttentionImpl` are applied as documented there, in this order:

- soft cap ``s -> c * tanh(s / c)`` on the scaled scores (Gemma 2);
- ALiBi ``m_h * (k - q)`` added to the scores, ``k`` and ``q`` absolute positions
  (Press et al. 2022);
- the mask: causal ``k <= q``; a sliding window ``w`` keeps ``q - w < k``
  (``|q - k| < w`` when bidirectional);
- sinks: a per-head logit that joins the softmax denominator and carries no value
  (gpt-oss): ``out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sink_h))``.

Slow by design; used by ``attn-di run``, the example engine's reference path and the
conformance kit (:mod:`attn_di.conformance`), which also runs :func:`sequence_attention` in
a model dtype to derive its tolerances.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from attn_di.backend import AttentionMetadata

__all__ = ["reference_attention", "sequence_attention"]

_QUERY_CHUNK = 256  # query rows per step: bounds the [H, rows, seq_len] scores


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in float64, reading cached positions from ``kv_cache`` and new ones from key/value.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` (rows past the batch's
            ``query_start_loc[-1]``, padding, are ignored and returned as zeros).
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the query tokens' own K/V
            (they take precedence over whatever the cache holds at their slots).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (not modified),
            any strides; or an empty tensor (no cache: encoder attention), in which case
            every sequence is its own query tokens.
        metadata: the batch (query_start_loc, seq_lens, block_table, causal).
        scale: the factor applied to ``q k^T``.
        sliding_window: w, or None (see the module docstring).
        logits_soft_cap: c, or None (or 0) for none.
        alibi_slopes: ``[num_heads]`` slopes, or None.
        sinks: ``[num_heads]`` sink logits, or None.

    Returns:
        ``[num_tokens, num_heads * head_size]`` float64.
    """
    import torch

    num_tokens, num_heads, head_size = query.shape
    output = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    cached = kv_cache.dim() == 5 and kv_cache.numel() > 0
    block_size = int(kv_cache.shape[2]) if cached else 1
    starts = metadata.query_start_loc.tolist()
    for index, seq_len in enumerate(metadata.seq_lens.tolist()):
        begin, end = starts[index], starts[index + 1]
        query_len = end - begin
        if query_len == 0:
            continue
        if cached:
            positions = torch.arange(seq_len)
            blocks = metadata.block_table[index, positions // block_size].long()
            offsets = positions % block_size
            keys = kv_cache[0, blocks, offsets].to(torch.float64)  # [seq_len, kv_heads, D]
            values = kv_cache[1, blocks, offsets].to(torch.float64)
            keys[seq_len - query_len :] = key[begin:end].to(torch.float64)
            values[seq_len - query_len :] = value[begin:end].to(torch.float64)
        else:
            keys = key[begin:end].to(torch.float64)
            values = value[begin:end].to(torch.float64)
        output[begin:end] = sequence_attention(
            query[begin:end],
            keys,
            values,
            scale,
            causal=bool(metadata.causal),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
        )
    return output.reshape(num_tokens, num_heads * head_size)


def sequence_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: Sequence[float] | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One sequence's attention: its ``q`` query tokens at its last ``q`` positions.

    Args:
        query: ``[q, num_heads, head_size]``.
        keys, values: ``[s, num_kv_heads, head_size]``, every position of the sequence
            (``s >= q``); query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        scale: the factor applied to ``q k^T``.
        causal: whether position ``p`` sees only keys ``k <= p``; False: bidirectional.
        sliding_window, logits_soft_cap, alibi_slopes, sinks: as :func:`reference_attention`.
        dtype: the dtype every step is computed in: float64 by default (the reference);
            a model dtype computes the same attention naively in it (each matmul, the cap,
            the bias and the softmax rounded to it), the conformance kit's measure of that
            dtype's own error.

    Returns:
        ``[q, num_heads, head_size]`` in ``dtype``.
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    q_len, num_heads, _ = query.shape
    s_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.to(dtype).repeat_interleave(group, dim=1)  # [s, H, D]
    values = values.to(dtype).repeat_interleave(group, dim=1)
    key_pos = torch.arange(s_len, dtype=torch.float64)
    slopes = None
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float64).reshape(num_heads, 1, 1)
    sink = None
    if sinks is not None:
        sink = torch.as_tensor(sinks).detach().to(dtype).reshape(num_heads, 1, 1)
    cap = logits_soft_cap or None
    pieces = []
    for first in range(0, q_len, _QUERY_CHUNK):
        rows = query[first : first + _QUERY_CHUNK].to(dtype)
        query_pos = torch.arange(s_len - q_len + first, s_len - q_len + first + rows.shape[0])
        query_pos = query_pos.to(torch.float64)[:, None]
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale  # [H, rows, s]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        if slopes is not None:
            scores = scores + (slopes * (key_pos[None, :] - query_pos)[None]).to(dtype)
        delta = query_pos - key_pos[None, :]  # [rows, s]
        visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
        if sliding_window is not None:
            visible = visible & (
                (delta < sliding_window) if causal else (delta.abs() < sliding_window)
            )
        scores = scores.masked_fill(~visible[None], float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        if sink is not None:
            peak = torch.maximum(peak, sink.expand_as(peak))
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        weights = torch.exp(scores - peak)
        denominator = weights.sum(dim=-1, keepdim=True)
        if sink is not None:
            denominator = denominator + torch.exp(sink - peak)
        pieces.append(torch.einsum("hqk,khd->qhd", weights / denominator, values))
    if not pieces:
        return torch.zeros(0, num_heads, values.shape[-1], dtype=dtype)
    return torch.cat(pieces)
