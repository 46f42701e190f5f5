"""A plain float64 attention reference and random paged batches, written apart from the backends.

The reference is ``softmax(q @ k^T * scale + mask) @ v`` (Vaswani et al. 2017), one
sequence and one head at a time, with the options of ``AttentionImpl`` applied exactly as
documented there: soft cap ``c * tanh(s / c)``, ALiBi ``m_h * (k - q)``, sliding window
``q - w < k <= q`` (``|q - k| < w`` when bidirectional), sinks in the denominator only.

Caches are dirty, as a server's are: :func:`dirty_kv_cache` allocates one full of NaN (or
+-Inf) in a backend's layout, and :func:`make_batch` writes only the slots its batch covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attn_di.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder


@dataclass
class Options:
    """The layer options of one case."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi_slopes: list[float] | None = None
    sinks: torch.Tensor | None = None
    encoder_only: bool = False

    @property
    def scale(self) -> float:
        """The usual ``head_size ** -0.5``."""
        return self.head_size**-0.5

    def impl_kwargs(self) -> dict[str, object]:
        """Keyword arguments for an impl constructor."""
        return {
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "scale": self.scale,
            "num_kv_heads": self.num_kv_heads,
            "alibi_slopes": self.alibi_slopes,
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
            "attn_type": "encoder_only" if self.encoder_only else "decoder",
            "sinks": self.sinks,
        }


@dataclass
class Batch:
    """A random batch: inputs, a pre-filled paged cache and each sequence's full K/V."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    full_keys: list[torch.Tensor] = field(default_factory=list)
    full_values: list[torch.Tensor] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)


DIRTY_FILLS = ("nan", "inf")
"""The fills of :func:`dirty_kv_cache` that poison a cache (``"zero"`` is the clean one)."""

KV_LAYOUTS: dict[str, tuple[int, ...] | None] = {
    "declared": None,
    "blocks-outermost": (1, 0, 2, 3, 4),
    "head-major": (0, 1, 3, 2, 4),
    "blocks-outermost-head-major": (1, 0, 3, 2, 4),
    "vllm-LBNHC": (1, 2, 3, 0, 4),
    "vllm-LBHNC": (1, 3, 2, 0, 4),
}
"""Physical layouts of a ``[2, num_blocks, block_size, H_kv, D]`` cache, as a stride order
(vLLM's ``get_kv_cache_stride_order``: the order of the logical axes in memory, outermost
first). ``"declared"``: the backend's own (``get_kv_cache_stride_order``);
``"blocks-outermost"``: the buffer vLLM hands a layer (block b's keys and values in one page);
the head-major ones keep each KV head's block contiguous, as vLLM's CPU backend does. The
``vllm-*`` ones are what vLLM 0.32 hands each layer (``[num_blocks, H_kv, block_size, 2 * D]``
in its layout ``LBNHC`` or ``LBHNC``, ``v1/kv_cache_layout.py``): key and value interleaved
in one row, so the K/V axis has the smallest stride but the last."""


def slot_index(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` index of cache slots in a plane ``kv_cache[i]``, any layout."""
    block_size = int(kv_cache.shape[2])
    return slots // block_size, slots % block_size


def dirty_kv_cache(
    backend_cls: type[AttentionBackend],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    fill: str = "nan",
    layout: str = "declared",
) -> torch.Tensor:
    """A KV cache as a server hands it over: every slot holds garbage until written.

    A real server allocates its cache uninitialised and reuses blocks, so a slot a
    sequence does not cover may hold anything. Numerics tests allocate their caches here,
    write the slots a batch covers, and so check that no backend reads any other slot.

    Args:
        backend_cls: the backend whose ``get_kv_cache_shape`` gives the layout.
        num_blocks, block_size, num_kv_heads, head_size: passed to ``get_kv_cache_shape``.
        dtype: the cache's dtype.
        fill: ``"nan"`` (every element NaN); ``"inf"`` (+Inf and -Inf alternating along the
            last axis, so a key scores NaN or +-Inf against any query, and a value turns any
            weighted sum it enters into Inf or NaN); ``"zero"`` (a clean cache, to compare
            against).
        layout: a key of :data:`KV_LAYOUTS`: the memory order of the cache's axes.

    Returns:
        The cache, of shape ``backend_cls.get_kv_cache_shape(...)`` and dtype ``dtype``, in
        ``layout`` (a permuted view of one buffer).

    Raises:
        ValueError: an unknown ``fill`` or ``layout``.
    """
    shape = tuple(backend_cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(KV_LAYOUTS)}, got {layout!r}")
    declared = getattr(backend_cls, "get_kv_cache_stride_order", None)  # optional (vLLM's too)
    order = KV_LAYOUTS[layout] or (tuple(declared()) if declared else tuple(range(len(shape))))
    physical = tuple(shape[axis] for axis in order)
    if fill == "nan":
        buffer = torch.full(physical, math.nan, dtype=dtype)
    elif fill == "inf":
        signs = torch.tensor([math.inf, -math.inf], dtype=dtype).repeat((shape[-1] + 1) // 2)
        buffer = signs[: shape[-1]].expand(physical).contiguous()
    elif fill == "zero":
        buffer = torch.zeros(physical, dtype=dtype)
    else:
        raise ValueError(f"fill must be one of {(*DIRTY_FILLS, 'zero')}, got {fill!r}")
    inverse = tuple(order.index(axis) for axis in range(len(order)))
    return buffer.permute(inverse)


def differs(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Elementwise ``after != before`` in which NaN equals NaN (caches are NaN-filled)."""
    return (after != before) & ~(after.isnan() & before.isnan())


def make_batch(
    opts: Options,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
    *,
    fill: str = "nan",
    pad_tokens: int = 0,
    backend_cls: type[AttentionBackend] = AttentionBackend,
    layout: str = "declared",
) -> Batch:
    """A batch whose cached prefixes are in a shuffled paged cache that is dirty elsewhere.

    The cache comes from :func:`dirty_kv_cache` (``fill``); only the cached prefixes are
    written, so the tail of each sequence's last block and the spare blocks (block 0 among
    them) hold the fill.
    Each block-table row has at least one column more than its sequence needs, and the
    entries past a sequence's blocks name blocks of other sequences (stale entries of reused
    blocks). ``pad_tokens`` rows of NaN query/key/value with slot -1 follow the real tokens
    (past ``num_actual_tokens``, as a server pads a batch). The random data depend on
    ``seed`` only, not on ``fill`` or ``layout`` (:data:`KV_LAYOUTS`), so two fills or two
    layouts give the same computation.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_heads, size = opts.num_kv_heads, opts.head_size
    if opts.encoder_only:
        seq_lens = list(query_lens)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + max(1, spare_blocks)
    # Block 0 stays unused (dirty), as the null block of vLLM's allocator does: a backend
    # that points the keys a sequence does not cover at slot 0 reads the fill.
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    width = max([*blocks_per_seq, 0]) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = order[used : used + count].int()
        used += count
        stale = (used + torch.arange(width - count)) % (num_blocks - 1)
        table[i, count:] = order[stale].int()
    cached_keys = torch.randn(num_blocks * block_size, kv_heads, size, generator=gen).to(dtype)
    cached_values = torch.randn(cached_keys.shape, generator=gen).to(dtype)
    kv_cache = dirty_kv_cache(
        backend_cls, num_blocks, block_size, kv_heads, size, dtype, fill, layout
    )
    builder = AttentionMetadataBuilder(block_size)
    metadata = builder.build(
        query_lens, seq_lens, None if opts.encoder_only else table, causal=not opts.encoder_only
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, opts.num_heads, size, generator=gen).to(dtype)
    key = torch.randn(num_tokens, kv_heads, size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kv_heads, size, generator=gen).to(dtype)
    batch = Batch(query, key, value, kv_cache, metadata, query_lens=list(query_lens))
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        new_k, new_v = key[start : start + q_len], value[start : start + q_len]
        start += q_len
        if opts.encoder_only:
            batch.full_keys.append(new_k.double())
            batch.full_values.append(new_v.double())
            continue
        positions = torch.arange(s_len - q_len)
        slots = table[i, positions // block_size].long() * block_size + positions % block_size
        kv_cache[0][slot_index(kv_cache, slots)] = cached_keys[slots]
        kv_cache[1][slot_index(kv_cache, slots)] = cached_values[slots]
        batch.full_keys.append(torch.cat([cached_keys[slots], new_k]).double())
        batch.full_values.append(torch.cat([cached_values[slots], new_v]).double())
    if opts.encoder_only:
        batch.kv_cache = torch.empty(0, dtype=dtype)
    if pad_tokens:
        batch.query, batch.key, batch.value = (
            torch.cat([t, torch.full((pad_tokens, *t.shape[1:]), math.nan, dtype=dtype)])
            for t in (query, key, value)
        )
        padding = torch.full((pad_tokens,), -1, dtype=metadata.slot_mapping.dtype)
        metadata.slot_mapping = torch.cat([metadata.slot_mapping, padding])
    return batch


def reference_attention(opts: Options, batch: Batch) -> torch.Tensor:
    """``[N, H * D]`` float64 attention of the batch, one sequence and head at a time."""
    outputs = []
    start = 0
    per_kv = opts.num_heads // opts.num_kv_heads
    for keys, values, q_len in zip(
        batch.full_keys, batch.full_values, batch.query_lens, strict=True
    ):
        if q_len == 0:
            continue
        query = batch.query[start : start + q_len].double()
        start += q_len
        s_len = keys.shape[0]
        q_pos = torch.arange(s_len - q_len, s_len, dtype=torch.float64)[:, None]
        k_pos = torch.arange(s_len, dtype=torch.float64)[None, :]
        delta = q_pos - k_pos
        visible = torch.ones(q_len, s_len, dtype=torch.bool)
        if not opts.encoder_only:
            visible &= delta >= 0
        if opts.sliding_window is not None:
            window = opts.sliding_window
            visible &= (delta.abs() < window) if opts.encoder_only else (delta < window)
        heads = []
        for h in range(opts.num_heads):
            kv = h // per_kv
            scores = query[:, h] @ keys[:, kv].T * opts.scale
            if opts.logits_soft_cap is not None:
                scores = opts.logits_soft_cap * torch.tanh(scores / opts.logits_soft_cap)
            if opts.alibi_slopes is not None:
                scores = scores + opts.alibi_slopes[h] * (k_pos - q_pos)
            scores = scores.masked_fill(~visible, -math.inf)
            peak = scores.max(dim=-1, keepdim=True).values
            sink = None
            if opts.sinks is not None:
                sink = float(opts.sinks[h])
                peak = peak.clamp_min(sink)
            weights = torch.exp(scores - peak)
            denom = weights.sum(dim=-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink - peak)
            heads.append((weights / denom) @ values[:, kv])
        outputs.append(torch.stack(heads, dim=1).reshape(q_len, -1))
    return torch.cat(outputs)
