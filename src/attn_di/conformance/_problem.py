"""A cell's batch: random sequences, a dirty paged cache, the layer's options (torch).

Every sequence's data depends only on the case, the run's seed and the sequence's index
(:func:`make_sequences`), so one request can be put into several batches
(:func:`assemble`), alone or among others, at any position: the batch-invariance cells
compare them.

The cache is dirty as a server's is: every slot that no cached prefix covers (the tail of
each last block, spare blocks, the null block 0, blocks that stale block-table entries
name) holds NaN, +Inf, -Inf, +max and -max of the dtype, cycling along each slot; in a
:attr:`~attn_di.conformance.Case.finite_tails` cell the unwritten slots of the blocks the
batch uses hold +max and -max only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attn_di.conformance._case import Case

__all__ = [
    "DIRTY_VALUES",
    "FINITE_VALUES",
    "LayerOptions",
    "Problem",
    "SequenceData",
    "assemble",
    "make_problem",
    "make_sequences",
]

SOFTCAP_DEFAULT = 2.0
"""The soft cap of the matrix's soft-capped cells: small enough that capping changes the
scores of N(0, 1) inputs well beyond any dtype's rounding."""
PAD_TOKENS = 3


def DIRTY_VALUES(dtype: torch.dtype) -> list[float]:  # noqa: N802 - a table, by dtype
    """What an unwritten slot holds: NaN, +Inf, -Inf, the dtype's largest and its negative."""
    largest = float(torch.finfo(dtype).max)
    return [math.nan, math.inf, -math.inf, largest, -largest]


def FINITE_VALUES(dtype: torch.dtype) -> list[float]:  # noqa: N802 - a table, by dtype
    """What an unwritten slot of a block in use holds in a :attr:`Case.finite_tails` cell:
    the dtype's largest value and its negative (a backend that gives such a slot any
    weight errs hugely; one that multiplies it by a zero weight does not)."""
    largest = float(torch.finfo(dtype).max)
    return [largest, -largest]


@dataclass(frozen=True)
class LayerOptions:
    """The attention layer of a cell.

    Attributes:
        num_heads, num_kv_heads, head_size: H, H_kv, D.
        scale: ``D ** -0.5``.
        window: sliding window or None.
        softcap: logits soft cap or None.
        alibi_slopes: ``[H]`` slopes ``2 ** (-8 h / H)`` (h = 1..H, Press et al.) or None.
        sinks: ``[H]`` float32 sink logits or None.
        attn_type: ``"decoder"``, ``"encoder"`` or ``"encoder_only"``.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    window: int | None
    softcap: float | None
    alibi_slopes: list[float] | None
    sinks: torch.Tensor | None
    attn_type: str


@dataclass(frozen=True)
class SequenceData:
    """One request: its new tokens and its cached prefix.

    Attributes:
        query: ``[q, H, D]``, key / value ``[q, H_kv, D]``: the new tokens, in the dtype.
        prefix_keys, prefix_values: ``[p, H_kv, D]``, the cached positions ``0 .. p-1``.
        shared_blocks: leading prefix blocks shared with the batch's other requests.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    prefix_keys: torch.Tensor
    prefix_values: torch.Tensor
    shared_blocks: int = 0

    @property
    def query_len(self) -> int:
        """Its new tokens."""
        return int(self.query.shape[0])

    @property
    def prefix_len(self) -> int:
        """Its cached positions."""
        return int(self.prefix_keys.shape[0])

    @property
    def seq_len(self) -> int:
        """Prefix plus new tokens."""
        return self.prefix_len + self.query_len

    def full_keys(self) -> torch.Tensor:
        """``[s, H_kv, D]``: every position's key."""
        return torch.cat([self.prefix_keys, self.key])

    def full_values(self) -> torch.Tensor:
        """``[s, H_kv, D]``: every position's value."""
        return torch.cat([self.prefix_values, self.value])


@dataclass
class Problem:
    """A batch ready for a driver, in the logical layout.

    Attributes:
        case: the cell.
        layer: its layer options.
        sequences: the requests, in batch order.
        query, key, value: ``[N + pad, H(_kv), D]``, padding rows NaN.
        num_tokens: N, the real tokens.
        query_lens, seq_lens: per request.
        block_size: tokens per block.
        block_table: ``[B, W]`` int32, or None without a cache.
        cache: ``[2, num_blocks, block_size, H_kv, D]`` (dirty, prefixes written) or None.
        slots: ``[N]`` int64, the slot each new token is written to, or None.
        pad: padding tokens after the real ones.
    """

    case: Case
    layer: LayerOptions
    sequences: list[SequenceData]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    block_table: torch.Tensor | None
    cache: torch.Tensor | None
    slots: torch.Tensor | None
    pad: int

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype."""
        return self.query.dtype

    @property
    def causal(self) -> bool:
        """Whether attention is causal (decoder kinds)."""
        return self.case.causal

    def sequence_of_token(self) -> torch.Tensor:
        """``[N]`` int64: each real token's request."""
        return torch.repeat_interleave(
            torch.arange(len(self.query_lens)), torch.tensor(self.query_lens, dtype=torch.long)
        )


def layer_options(case: Case, seed: int) -> LayerOptions:
    """The layer of ``case`` (sinks drawn from the cell's seed)."""
    heads = case.num_heads
    sinks = None
    if case.sinks:
        generator = torch.Generator().manual_seed(case.data_seed(seed) + 7)
        sinks = torch.rand(heads, generator=generator, dtype=torch.float64) * 4.0 - 1.0
        sinks = sinks.float()
    return LayerOptions(
        num_heads=heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        scale=case.head_size**-0.5,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=[2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)]
        if case.alibi
        else None,
        sinks=sinks,
        attn_type=case.attn_type,
    )


def _lengths(case: Case, rng: random.Random) -> list[tuple[int, int]]:
    """``(query_len, seq_len)`` of each request of the cell."""
    longest = case.seq_len

    def other() -> int:
        return rng.randint(1, longest)

    def chunk(total: int) -> int:
        return max(1, min(total - 1, rng.randint(2, 16))) if total > 1 else 1

    kind = case.kind
    if kind in ("prefill", "encoder", "encoder_only"):
        totals = [longest, other()]
        return [(s, s) for s in totals]
    if kind == "decode":
        return [(1, s) for s in (longest, other(), other())]
    if kind == "chunked":
        return [(chunk(s), s) for s in (longest, other())]
    if kind == "spec":
        return [(min(s, rng.randint(2, 8)), s) for s in (longest, other())]
    # mixed: a prefill, a chunked prefill and two decodes
    prefill = other()
    return [(prefill, prefill), (chunk(longest), longest), (1, other()), (1, other())]


def make_sequences(case: Case, seed: int) -> list[SequenceData]:
    """The cell's requests; request ``i``'s data depend on ``(case, seed, i)`` only.

    With ``case.table == "shared"`` the requests with a cached prefix of a whole block or
    more share their first blocks (the same keys and values: prefix caching).
    """
    base = case.data_seed(seed)
    rng = random.Random(base)
    lengths = _lengths(case, rng)
    heads, kv_heads, size = case.num_heads, case.num_kv_heads, case.head_size
    dtype = getattr(torch, case.dtype)
    shared_blocks = 0
    if case.table == "shared" and case.uses_cache:
        prefixes = [s - q for q, s in lengths if s - q >= case.block_size]
        if len(prefixes) >= 2:
            shared_blocks = max(1, min(prefixes) // case.block_size)
    shared_len = shared_blocks * case.block_size
    shared_gen = torch.Generator().manual_seed(base + 1)
    shared_keys = torch.randn(shared_len, kv_heads, size, generator=shared_gen).to(dtype)
    shared_values = torch.randn(shared_len, kv_heads, size, generator=shared_gen).to(dtype)
    sequences = []
    for index, (q_len, s_len) in enumerate(lengths):
        generator = torch.Generator().manual_seed(base + 1000 * (index + 1))
        prefix = s_len - q_len if case.uses_cache else 0
        if not case.uses_cache:
            q_len = s_len
        shares = shared_blocks if shared_blocks and prefix >= shared_len else 0
        own = prefix - shares * case.block_size
        prefix_keys = torch.randn(own, kv_heads, size, generator=generator).to(dtype)
        prefix_values = torch.randn(own, kv_heads, size, generator=generator).to(dtype)
        if shares:
            prefix_keys = torch.cat([shared_keys, prefix_keys])
            prefix_values = torch.cat([shared_values, prefix_values])
        sequences.append(
            SequenceData(
                query=torch.randn(q_len, heads, size, generator=generator).to(dtype),
                key=torch.randn(q_len, kv_heads, size, generator=generator).to(dtype),
                value=torch.randn(q_len, kv_heads, size, generator=generator).to(dtype),
                prefix_keys=prefix_keys,
                prefix_values=prefix_values,
                shared_blocks=shares,
            )
        )
    return sequences


def assemble(
    case: Case, layer: LayerOptions, sequences: Sequence[SequenceData], seed: int
) -> Problem:
    """The batch of ``sequences`` in this order: a shuffled, dirty paged cache holding their
    prefixes, a block table whose unused columns name other blocks (stale entries), and
    (``case.padded``) NaN padding tokens."""
    dtype = sequences[0].query.dtype
    block_size = case.block_size
    kv_heads, size = layer.num_kv_heads, layer.head_size
    query = torch.cat([s.query for s in sequences])
    key = torch.cat([s.key for s in sequences])
    value = torch.cat([s.value for s in sequences])
    num_tokens = int(query.shape[0])
    pad = PAD_TOKENS if case.padded else 0
    if pad:
        query, key, value = (
            torch.cat([t, torch.full((pad, *t.shape[1:]), math.nan, dtype=dtype)])
            for t in (query, key, value)
        )
    query_lens = [s.query_len for s in sequences]
    seq_lens = [s.seq_len for s in sequences]
    if not case.uses_cache:
        return Problem(
            case, layer, list(sequences), query, key, value, num_tokens, query_lens, seq_lens,
            block_size, None, None, None, pad,
        )  # fmt: skip
    rng = random.Random(case.data_seed(seed) + 17 * len(sequences))
    blocks_needed = [math.ceil(s.seq_len / block_size) for s in sequences]
    shared = max((s.shared_blocks for s in sequences), default=0)
    distinct = sum(n - s.shared_blocks for n, s in zip(blocks_needed, sequences, strict=True))
    distinct += shared
    num_blocks = distinct + 3  # block 0 (the null block) and two spare blocks stay dirty
    physical = list(range(1, num_blocks))
    rng.shuffle(physical)
    shared_ids = physical[:shared]
    next_free = shared
    width = max(blocks_needed) + 1
    table = torch.zeros(len(sequences), width, dtype=torch.int32)
    for row, (needed, sequence) in enumerate(zip(blocks_needed, sequences, strict=True)):
        own = needed - sequence.shared_blocks
        ids = shared_ids[: sequence.shared_blocks] + physical[next_free : next_free + own]
        next_free += own
        stale = [rng.choice(physical) for _ in range(width - needed)]
        table[row] = torch.tensor(ids + stale, dtype=torch.int32)
    cache = _dirty((2, num_blocks, block_size, kv_heads, size), dtype)
    if case.finite_tails:
        used = sorted({int(b) for row, n in enumerate(blocks_needed) for b in table[row, :n]})
        cache[:, used] = _dirty(tuple(cache[:, used].shape), dtype, FINITE_VALUES(dtype))
    slots = []
    for row, sequence in enumerate(sequences):
        positions = torch.arange(sequence.seq_len)
        seq_slots = table[row, positions // block_size].long() * block_size + positions % block_size
        prefix = seq_slots[: sequence.prefix_len]
        cache[0].view(-1, kv_heads, size)[prefix] = sequence.prefix_keys
        cache[1].view(-1, kv_heads, size)[prefix] = sequence.prefix_values
        slots.append(seq_slots[sequence.prefix_len :])
    return Problem(
        case, layer, list(sequences), query, key, value, num_tokens, query_lens, seq_lens,
        block_size, table, cache, torch.cat(slots), pad,
    )  # fmt: skip


def make_problem(case: Case, seed: int) -> Problem:
    """The cell's batch: :func:`make_sequences` assembled in order."""
    return assemble(case, layer_options(case, seed), make_sequences(case, seed), seed)


def _dirty(
    shape: tuple[int, ...], dtype: torch.dtype, values: list[float] | None = None
) -> torch.Tensor:
    """A tensor whose elements cycle through ``values`` (:func:`DIRTY_VALUES`) along its
    flat order, so every slot sees several of them."""
    pattern = torch.tensor(DIRTY_VALUES(dtype) if values is None else values, dtype=dtype)
    count = math.prod(shape)
    return pattern.repeat(count // len(pattern) + 1)[:count].reshape(shape).clone()
