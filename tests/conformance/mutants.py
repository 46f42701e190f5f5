"""Deliberately broken attention backends ("mutants") that the conformance kit must catch.

Each mutant is a backend class (importable by class path, e.g.
``tests.conformance.mutants:WindowOffByOne``) made of a correct attn_di backend, TORCH_SDPA
or CPU_ATTN, and its impl with one small bug. The bug is one a real kernel makes: a window
bound off by one, a masked key whose garbage value still enters ``weights @ V``, a running
sum kept in bfloat16, ... Every mutant says, in class attributes, which feature of the kit's
matrix its bug breaks (:attr:`Mutant.feature`, one of the features of the kit's cells) and
which verdict the kit owes it (:attr:`Mutant.outcome`, the name of an ``Outcome``), so
tests/conformance/test_mutants.py can check that the kit's default run names them.

Hooks used (attn_di's own, not public API: these are test doubles):

* TORCH_SDPA's ``_attend(query, key_src, value_src, group)`` attends one
  :class:`~attn_di.backends._common.SeqGroup` (padded query rows, key rows, the ``allowed``
  mask): a mutant edits the group (mask, key rows) or the queries before calling it;
* the constructor's options (``self.scale``, ``self.sliding_window``, ``self.sinks``, ...),
  which ``forward`` reads on every call;
* ``forward`` itself, wrapped: a mutant rewrites the metadata before, or the output after.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import threading
from typing import Any, ClassVar

import torch

from attn_di.backend import AttentionImpl, AttentionMetadata
from attn_di.backends._common import CacheRows, SeqGroup, cache_rows, uses_cache
from attn_di.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from attn_di.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl
from attn_di.exceptions import InvalidInputError

__all__ = [
    "MUTANTS",
    "AlibiIgnored",
    "BatchPositionDependent",
    "Bf16Accumulation",
    "BlockTableIgnored",
    "ChunkedCausalOffset",
    "CrashOnBadInput",
    "DeclaresSoftCap",
    "FailsUndeclared",
    "Mutant",
    "Nondeterministic",
    "OutputArgIgnored",
    "ReadsPastSeqLen",
    "ScaleTwice",
    "SinksIgnored",
    "SoftCapIgnored",
    "ThreadUnsafe",
    "WindowOffByOne",
    "WorksUndeclared",
    "WrongKVHeads",
    "WrongPrefill",
]


class Mutant:
    """Mixin of a mutant backend class: its name, impl, the feature it breaks, its verdict.

    Attributes:
        impl_cls: the mutant's impl; its ``backend`` is set to the mutant class.
        feature: a feature of the kit's cells (``Case.features``) that the bug breaks: some
            failing cell of the default run must carry it.
        outcome: the name of the ``Outcome`` those cells must get (``"FAIL"`` unless said).
        report_ok: whether the whole report is still ok (only for a mutant that is correct).
    """

    impl_cls: ClassVar[type[AttentionImpl]]
    feature: ClassVar[str]
    outcome: ClassVar[str] = "FAIL"
    report_ok: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "impl_cls" in cls.__dict__:
            cls.impl_cls.backend = cls  # type: ignore[misc]

    @classmethod
    def get_name(cls) -> str:
        """``MUTANT_`` and the class name in upper snake case (``MUTANT_SCALE_TWICE``)."""
        return "MUTANT_" + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls.__name__).upper()

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """:attr:`impl_cls`."""
        return cls.impl_cls


class _SdpaImpl(TorchSDPAImpl):
    """TORCH_SDPA's impl that keeps this call's metadata and cache for its ``_attend``
    (per thread: two threads may call one impl at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._call = threading.local()

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
        self._call.metadata, self._call.kv_cache = attn_metadata, kv_cache
        try:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        finally:
            self._call.metadata = self._call.kv_cache = None

    def _row_seqs(self, group: SeqGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(seq, q_len, seq_len)``, ``[b]`` each: the batch index of each row of the group
        (-1 for a row without a query token here) and its sequence's query and total length
        (total = query length where there is no cache)."""
        metadata: AttentionMetadata = self._call.metadata
        starts = metadata.query_start_loc.long()
        has_query = group.query_valid.any(-1)
        first = group.query_index.gather(1, group.query_valid.long().argmax(-1, keepdim=True))
        seq = torch.searchsorted(starts[1:], first[:, 0], right=True)
        seq = torch.where(has_query, seq, -1)
        q_lens = (starts[1:] - starts[:-1])[seq.clamp_min(0)]
        seq_lens = metadata.seq_lens.long()[seq.clamp_min(0)] if uses_cache(self) else q_lens
        return seq, q_lens, seq_lens

    def _key_valid(self, group: SeqGroup) -> torch.Tensor:
        """``[b, 1, Lk]`` bool: the keys each row's sequence has."""
        _, _, seq_lens = self._row_seqs(group)
        return (group.key_pos()[None, :] < seq_lens[:, None])[:, None, :]


# --- the layer options -------------------------------------------------------------------


class _WindowOffByOneImpl(_SdpaImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sliding_window is not None:
            self.sliding_window += 1  # sees w + 1 keys: q - w <= k <= q


class WindowOffByOne(Mutant, TorchSDPABackend):
    """A sliding window one key too wide: query p sees key ``p - w`` too."""

    impl_cls = _WindowOffByOneImpl
    feature = "window"


class _SoftCapIgnoredImpl(CPUAttentionImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logits_soft_cap = None  # accepted, then never applied


class SoftCapIgnored(Mutant, CPUAttentionBackend):
    """CPU_ATTN (kernel or pure torch) that accepts ``logits_soft_cap`` and ignores it."""

    impl_cls = _SoftCapIgnoredImpl
    feature = "softcap"


class _AlibiIgnoredImpl(_SdpaImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alibi_slopes = None


class AlibiIgnored(Mutant, TorchSDPABackend):
    """Accepts ``alibi_slopes`` and adds no bias."""

    impl_cls = _AlibiIgnoredImpl
    feature = "alibi"


class _SinksIgnoredImpl(_SdpaImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = None


class SinksIgnored(Mutant, TorchSDPABackend):
    """Declares sinks (as TORCH_SDPA does), accepts them and leaves them out of the softmax."""

    impl_cls = _SinksIgnoredImpl
    feature = "sinks"


class _ScaleTwiceImpl(_SdpaImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = self.scale * self.scale  # q @ k^T * scale * scale


class ScaleTwice(Mutant, TorchSDPABackend):
    """The scale applied twice: scores ``q @ k^T * scale**2`` (wrong in every cell)."""

    impl_cls = _ScaleTwiceImpl
    feature = "decode"


class _DeclaresSoftCapImpl(_SdpaImpl):
    supports_logits_soft_cap: ClassVar[bool] = True  # SDPA has no score modifier


class DeclaresSoftCap(Mutant, TorchSDPABackend):
    """TORCH_SDPA declaring ``logits_soft_cap`` (its impl's ``supports_logits_soft_cap``),
    which it cannot apply: it accepts the cap and computes without it."""

    impl_cls = _DeclaresSoftCapImpl
    feature = "softcap"


# --- heads and positions -----------------------------------------------------------------


class _WrongKVHeadsImpl(_SdpaImpl):
    """Query head h reads KV head ``h % num_kv_heads`` instead of ``h // group``.

    TORCH_SDPA folds query head j onto KV head ``j // group``; the queries are permuted so
    that folded head j is query head ``h(j) = (j % group) * num_kv_heads + j // group``,
    whose KV head is then ``j // group = h(j) % num_kv_heads``, and the outputs permuted back.
    Per-head options (ALiBi slopes, sinks) follow their head. Only wrong for GQA with
    ``1 < num_kv_heads < num_heads`` (MHA and MQA map every head right either way).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        group, kv_heads = self.num_queries_per_kv, self.num_kv_heads
        self._heads = torch.tensor(
            [(j % group) * kv_heads + j // group for j in range(self.num_heads)]
        )
        if self.alibi_slopes is not None:
            self.alibi_slopes = [self.alibi_slopes[h] for h in self._heads.tolist()]
        if self.sinks is not None:
            self.sinks = self.sinks[self._heads]

    def _attend(
        self, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor, group: SeqGroup
    ) -> torch.Tensor:
        folded = super()._attend(query[:, self._heads], key_src, value_src, group)
        result = torch.empty_like(folded)
        result[:, self._heads] = folded
        return result


class WrongKVHeads(Mutant, TorchSDPABackend):
    """GQA heads mapped ``h % num_kv_heads`` (interleaved) instead of ``h // group``."""

    impl_cls = _WrongKVHeadsImpl
    feature = "gqa"


class _ChunkedCausalOffsetImpl(_SdpaImpl):
    """A chunk's queries placed at positions 0, 1, ... instead of after the cached prefix:
    query j of a chunk over a prefix sees keys ``0..j`` (and its window from j). Right for
    prefill (no prefix) and decode (one query, which sees every key)."""

    def _attend(
        self, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor, group: SeqGroup
    ) -> torch.Tensor:
        _, q_lens, seq_lens = self._row_seqs(group)
        prefix = (seq_lens - q_lens)[:, None]
        chunked = ((q_lens > 1) & (prefix[:, 0] > 0))[:, None, None]
        if bool(chunked.any()) and uses_cache(self):
            wrong_pos = group.query_pos - prefix  # [b, Lq]
            delta = wrong_pos[:, :, None] - group.key_pos()[None, None, :]
            wrong = self._key_valid(group) & group.query_valid[:, :, None] & (delta >= 0)
            if self.sliding_window is not None:
                wrong &= delta < self.sliding_window
            group = dataclasses.replace(group, allowed=torch.where(chunked, wrong, group.allowed))
        return super()._attend(query, key_src, value_src, group)


class ChunkedCausalOffset(Mutant, TorchSDPABackend):
    """Chunked prefill's causal mask forgets the cached prefix (offset 0 instead of
    ``seq_len - query_len``)."""

    impl_cls = _ChunkedCausalOffsetImpl
    feature = "chunked"


class _WrongPrefillImpl(_SdpaImpl):
    """Sequences of more than one query token attend without the causal mask (every query
    sees every key of its sequence, the window's far side kept); single-token queries
    (decode) see only the past anyway and are right."""

    def _attend(
        self, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor, group: SeqGroup
    ) -> torch.Tensor:
        _, q_lens, _ = self._row_seqs(group)
        multi = (q_lens > 1)[:, None, None]
        if bool(multi.any()) and uses_cache(self):
            delta = group.query_pos[:, :, None] - group.key_pos()[None, None, :]
            wrong = self._key_valid(group) & group.query_valid[:, :, None]
            if self.sliding_window is not None:
                wrong &= delta < self.sliding_window
            group = dataclasses.replace(group, allowed=torch.where(multi, wrong, group.allowed))
        return super()._attend(query, key_src, value_src, group)


class WrongPrefill(Mutant, TorchSDPABackend):
    """Decode is right; prefill (any query of more than one token) is not causal."""

    impl_cls = _WrongPrefillImpl
    feature = "prefill"


# --- the paged cache ---------------------------------------------------------------------


class _ReadsPastSeqLenImpl(_SdpaImpl):
    """Gathers keys/values through the block table up to one position past the group's
    longest sequence, slots past each sequence's end included, and masks them: the mask
    gives them weight 0, but ``0 * NaN`` is NaN in ``weights @ V``. Right on a clean cache;
    NaN (or Inf) wherever the cache is dirty past a sequence's end."""

    def _attend(
        self, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor, group: SeqGroup
    ) -> torch.Tensor:
        if not uses_cache(self):
            return super()._attend(query, key_src, value_src, group)
        metadata: AttentionMetadata = self._call.metadata
        cache: CacheRows = cache_rows(self._call.kv_cache)
        seq, _, _ = self._row_seqs(group)
        width = int(group.kv_index.shape[1]) + 1
        positions = torch.arange(width)
        table = metadata.block_table.long()[seq.clamp_min(0)]
        column = (positions // cache.block_size).clamp_max(int(table.shape[1]) - 1)
        slots = table[:, column] * cache.block_size + positions % cache.block_size
        rows = cache.rows(slots)
        first = group.kv_index[:, :1].expand(-1, width)
        kv_index = torch.where((seq >= 0)[:, None], rows, first)
        allowed = torch.cat([group.allowed, group.allowed[..., :1] & False], dim=-1)
        group = dataclasses.replace(group, kv_index=kv_index, allowed=allowed)
        return super()._attend(query, key_src, value_src, group)


class ReadsPastSeqLen(Mutant, TorchSDPABackend):
    """Reads (masked) cache slots past ``seq_len``: shows only with a dirty cache."""

    impl_cls = _ReadsPastSeqLenImpl
    feature = "dirty_cache"


class _BlockTableIgnoredImpl(_SdpaImpl):
    """Reads sequence i's position p from block ``p // block_size`` (blocks 0, 1, ...), not
    from ``block_table[i, p // block_size]``; the new keys are still written at their slots."""

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
        table = attn_metadata.block_table
        if uses_cache(self) and kv_cache.dim() == 5 and table.dim() == 2:
            blocks = torch.arange(int(table.shape[1]), dtype=table.dtype, device=table.device)
            blocks = blocks.clamp_max(max(0, int(kv_cache.shape[1]) - 1))
            identity = blocks.expand(table.shape).contiguous()
            attn_metadata = dataclasses.replace(attn_metadata, block_table=identity)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)


class BlockTableIgnored(Mutant, TorchSDPABackend):
    """Ignores the block table (reads blocks 0..n): wrong wherever blocks are shuffled."""

    impl_cls = _BlockTableIgnoredImpl
    feature = "shuffled_blocks"


# --- precision ---------------------------------------------------------------------------

#: Keys per step of :class:`Bf16Accumulation`'s running sums.
ACCUMULATION_CHUNK = 8


class _Bf16AccumulationImpl(_SdpaImpl):
    """Flash-style online softmax whose running numerator and denominator are kept in the
    input dtype (bf16/fp16): every :data:`ACCUMULATION_CHUNK` keys they are rounded to it, so
    over a long context the small late terms are lost (a sum of n terms rounded n / 8 times,
    not once). Exact up to the dtype's rounding over one chunk; float32 inputs, ALiBi and
    sinks go to TORCH_SDPA unchanged."""

    def _attend(
        self, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor, group: SeqGroup
    ) -> torch.Tensor:
        dtype = query.dtype
        if dtype == torch.float32 or self.alibi_slopes is not None or self.sinks is not None:
            return super()._attend(query, key_src, value_src, group)
        per_kv = self.num_queries_per_kv
        queries = query[group.query_index].transpose(1, 2)  # [b, H, Lq, D]
        keys = key_src[group.kv_index].transpose(1, 2).repeat_interleave(per_kv, 1)
        values = value_src[group.kv_index].transpose(1, 2).repeat_interleave(per_kv, 1)
        allowed = group.allowed[:, None]  # [b, 1, Lq, Lk]
        shape = (*queries.shape[:3], 1)
        peak = torch.full(shape, -math.inf)
        denom = torch.zeros(shape, dtype=dtype)
        acc = torch.zeros(queries.shape, dtype=dtype)
        for start in range(0, int(keys.shape[2]), ACCUMULATION_CHUNK):
            stop = start + ACCUMULATION_CHUNK
            scores = (queries @ keys[:, :, start:stop].transpose(-1, -2)).float() * self.scale
            scores = scores.masked_fill(~allowed[..., start:stop], -math.inf)
            new_peak = torch.maximum(peak, scores.amax(-1, keepdim=True))
            safe = torch.where(torch.isfinite(new_peak), new_peak, 0.0)
            weights = torch.exp(scores - safe).to(dtype)
            rescale = torch.exp(peak - safe).to(dtype)
            denom = denom * rescale + weights.sum(-1, keepdim=True)
            acc = acc * rescale + weights @ values[:, :, start:stop]
            peak = new_peak
        return acc / torch.where(denom > 0, denom, 1)


class Bf16Accumulation(Mutant, TorchSDPABackend):
    """Accumulates softmax and ``P @ V`` in bf16 (fp16) over the context: fails long ones."""

    impl_cls = _Bf16AccumulationImpl
    feature = "bf16"


# --- the batch ---------------------------------------------------------------------------

#: Relative change per batch position of :class:`BatchPositionDependent`'s output.
POSITION_DRIFT = 1e-2


def _seq_of_token(metadata: AttentionMetadata) -> torch.Tensor:
    """``[num_actual_tokens]`` int64: each query token's batch index."""
    starts = metadata.query_start_loc.long()
    return torch.repeat_interleave(torch.arange(len(starts) - 1), starts[1:] - starts[:-1])


class _BatchPositionDependentImpl(_SdpaImpl):
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
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        seq = _seq_of_token(attn_metadata)
        rows = result[: int(seq.shape[0])]
        factor = 1 + POSITION_DRIFT * seq.to(torch.float32)[:, None]
        rows.copy_((rows.float() * factor).to(rows.dtype))
        return result


class BatchPositionDependent(Mutant, TorchSDPABackend):
    """Request i's output scaled by ``1 + i * POSITION_DRIFT``: right for the batch's first
    request only, so a request's answer depends on where it sits in the batch."""

    impl_cls = _BatchPositionDependentImpl
    feature = "batch_invariance"


_calls = itertools.count(1)


class _NondeterministicImpl(_SdpaImpl):
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
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        flat = result[: attn_metadata.num_actual_tokens].reshape(-1)
        if flat.numel():
            # A generator of its own, seeded by a process-wide call count: torch's global
            # seed (which a kit may set before each call) does not make two calls agree.
            generator = torch.Generator().manual_seed(next(_calls))
            where = torch.rand(flat.shape, generator=generator) < 0.05
            where[int(torch.randint(flat.numel(), (), generator=generator))] = True
            nudged = torch.nextafter(flat, torch.full_like(flat, math.inf))  # one ulp up
            flat.copy_(torch.where(where, nudged, flat))
        return result


class Nondeterministic(Mutant, TorchSDPABackend):
    """Right within any tolerance (a few outputs one ulp up, different ones on each call),
    but two identical calls differ: only the determinism check sees it."""

    impl_cls = _NondeterministicImpl
    feature = "determinism"


class _OutputArgIgnoredImpl(_SdpaImpl):
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
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, None)


class OutputArgIgnored(Mutant, TorchSDPABackend):
    """Returns a new tensor and leaves ``output=`` as it was (declares
    ``accept_output_buffer``, as every attn_di backend does)."""

    impl_cls = _OutputArgIgnoredImpl
    feature = "output_arg"


class _ThreadUnsafeImpl(_SdpaImpl):
    """Stages its result in one scratch buffer per impl (not per thread) before copying it
    out. Off the main thread, a call waits there (a long kernel) until another call stages
    its own result, which overwrites the first's: the first returns (part of) the second's
    answer. Deterministic, so the kit's two threads always see it."""

    #: Seconds a call off the main thread waits for another one, at most.
    wait: ClassVar[float] = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged = threading.Condition()
        self._waiting = 0
        self._scratch: torch.Tensor | None = None

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
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        count = result.numel()
        with self._staged:
            scratch = self._scratch
            if scratch is None or scratch.numel() < count or scratch.dtype != result.dtype:
                scratch = self._scratch = result.new_empty(count)
            scratch[:count].copy_(result.reshape(-1))
            if self._waiting:
                self._staged.notify_all()
            elif threading.current_thread() is not threading.main_thread():
                self._waiting += 1
                self._staged.wait(self.wait)
                self._waiting -= 1
            result.copy_(self._scratch[:count].view_as(result))
        return result


class ThreadUnsafe(Mutant, TorchSDPABackend):
    """Two threads calling one impl at once: each may compute the other's inputs."""

    impl_cls = _ThreadUnsafeImpl
    feature = "threads"


# --- input validation --------------------------------------------------------------------


class _CrashOnBadInputImpl(_SdpaImpl):
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
        try:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        except InvalidInputError:
            os.abort()  # as a kernel that reads out of bounds would, instead of a typed error


class CrashOnBadInput(Mutant, TorchSDPABackend):
    """Right on good inputs; aborts the process (SIGABRT) on a malformed one."""

    impl_cls = _CrashOnBadInputImpl
    feature = "bad_input"
    outcome = "CRASH"


# --- declarations ------------------------------------------------------------------------


class _UndeclaredSinksImpl(_SdpaImpl):
    """Accepts sinks although its backend does not declare them."""

    def _require(self, requested: bool, supported: bool, feature: str) -> None:
        if feature != "sinks":
            super()._require(requested, supported, feature)


class _WorksUndeclaredImpl(_UndeclaredSinksImpl):
    pass


class WorksUndeclared(Mutant, TorchSDPABackend):
    """Right, but declares less than it does: sinks work and are not declared
    (``supports_sink()`` False, so ``validate_configuration(has_sink=True)`` refuses them)."""

    impl_cls = _WorksUndeclaredImpl
    feature = "sinks"
    outcome = "WORKS_UNDECLARED"
    report_ok = True

    @classmethod
    def supports_sink(cls) -> bool:
        """False (the impl takes them anyway)."""
        return False


class _FailsUndeclaredImpl(_UndeclaredSinksImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = None


class FailsUndeclared(Mutant, TorchSDPABackend):
    """Neither declares sinks nor refuses them, and ignores them: answers wrong."""

    impl_cls = _FailsUndeclaredImpl
    feature = "sinks"
    outcome = "FAIL_UNDECLARED"

    @classmethod
    def supports_sink(cls) -> bool:
        """False (the impl takes them anyway, and ignores them)."""
        return False


MUTANTS: tuple[type[Mutant], ...] = (
    WindowOffByOne,
    SoftCapIgnored,
    AlibiIgnored,
    SinksIgnored,
    ScaleTwice,
    DeclaresSoftCap,
    WrongKVHeads,
    ChunkedCausalOffset,
    WrongPrefill,
    ReadsPastSeqLen,
    BlockTableIgnored,
    Bf16Accumulation,
    BatchPositionDependent,
    Nondeterministic,
    OutputArgIgnored,
    ThreadUnsafe,
    CrashOnBadInput,
    WorksUndeclared,
    FailsUndeclared,
)
"""Every mutant, in the order of this module."""
