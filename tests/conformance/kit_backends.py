"""Small backends of the kit's own tests: a correct one built on the float64 reference, and
variants that end in each outcome (importable by path, as the subprocess cells need).

The mutants that the default run must catch are in ``mutants.py``; these are the kit's own
fixtures: each one exists to produce one outcome or one tolerance case.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from attn_di.backend import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionType
from attn_di.backends._common import check_inputs, uses_cache, write_kv_cache
from attn_di.reference import reference_attention


class ReferenceBackend(AttentionBackend):
    """Correct by construction: the float64 reference, rounded to the model dtype. Declares
    fp32/bf16/fp16, any head and block size, decoder and encoder-only attention, sliding
    windows, ALiBi and sinks, not the soft cap."""

    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supported_attn_types: ClassVar[tuple[str, ...]] = (
        AttentionType.DECODER,
        AttentionType.ENCODER_ONLY,
    )

    @staticmethod
    def get_name() -> str:
        return "REFERENCE_TEST"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return ReferenceImpl

    @classmethod
    def supports_sink(cls) -> bool:
        return True


class ReferenceImpl(AttentionImpl):
    """Checks like attn_di's backends, writes the cache, then the reference."""

    backend: ClassVar[type[AttentionBackend]] = ReferenceBackend
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
        check_inputs(self, query, key, value, kv_cache, attn_metadata, output)
        count = attn_metadata.num_actual_tokens
        if uses_cache(self):
            write_kv_cache(key[:count], value[:count], kv_cache, attn_metadata.slot_mapping)
        rows = self._attend(query[:count], key[:count], value[:count], kv_cache, attn_metadata)
        result = output
        if result is None:
            result = torch.empty(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype)
        result[:count] = rows.to(query.dtype)
        return result

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return reference_attention(
            query,
            key,
            value,
            kv_cache if uses_cache(self) else torch.empty(0),
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
        )


class Bf16AccumulatingBackend(ReferenceBackend):
    """Online softmax whose running state (max, sum of exp, weighted sum) is kept in the
    model dtype, 16 keys at a time: right over short contexts, wrong in bfloat16 over long
    ones. Plain causal attention only."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return Bf16AccumulatingImpl


class Bf16AccumulatingImpl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = Bf16AccumulatingBackend

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        dtype = query.dtype
        block_size = kv_cache.shape[2]
        rows = []
        starts = metadata.query_start_loc.tolist()
        group = self.num_heads // self.num_kv_heads
        for index, seq_len in enumerate(metadata.seq_lens.tolist()):
            positions = torch.arange(seq_len)
            blocks = metadata.block_table[index, positions // block_size].long()
            keys = kv_cache[0, blocks, positions % block_size].repeat_interleave(group, dim=1)
            values = kv_cache[1, blocks, positions % block_size].repeat_interleave(group, dim=1)
            for token in range(starts[index], starts[index + 1]):
                visible = seq_len - (starts[index + 1] - token) + 1
                q = query[token].float()
                peak = torch.full((self.num_heads,), -torch.inf, dtype=dtype)
                total = torch.zeros(self.num_heads, dtype=dtype)
                acc = torch.zeros(self.num_heads, self.head_size, dtype=dtype)
                for first in range(0, visible, 16):
                    k = keys[first:visible][:16].float()
                    v = values[first:visible][:16].float()
                    # elementwise, not einsum: tiny matmuls pay a thread-pool round trip each
                    scores = (k.transpose(0, 1) * q[:, None, :]).sum(-1) * self.scale
                    new_peak = torch.maximum(peak.float(), scores.amax(-1))
                    weights = torch.exp(scores - new_peak[:, None])
                    keep = torch.exp(peak.float() - new_peak)
                    total = (total.float() * keep + weights.sum(-1)).to(dtype)
                    weighted = (weights[:, :, None] * v.transpose(0, 1)).sum(1)
                    acc = acc.float() * keep[:, None] + weighted
                    acc = acc.to(dtype)
                    peak = new_peak.to(dtype)
                rows.append((acc.float() / total.float()[:, None]).reshape(-1))
        return torch.stack(rows)


class Head64Backend(ReferenceBackend):
    """Declares head size 64 only, and computes every head size correctly: the head-size
    probe "works, not declared"."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64]

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return Head64Impl


class Head64Impl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = Head64Backend


class Head64GarbageBackend(Head64Backend):
    """Declares head size 64 only, does not refuse others, and answers zeros for them: the
    head-size probe fails, not declared."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return Head64GarbageImpl


class Head64GarbageImpl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = Head64GarbageBackend

    def _attend(self, query: torch.Tensor, *args: Any) -> torch.Tensor:
        rows = super()._attend(query, *args)
        return rows if self.head_size == 64 else torch.zeros_like(rows)


class UntypedRefusalBackend(ReferenceBackend):
    """Does not declare ALiBi and refuses it with a RuntimeError (not a typed error)."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return UntypedRefusalImpl


class UntypedRefusalImpl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = UntypedRefusalBackend
    supports_alibi: ClassVar[bool] = False

    def __init__(self, *args: Any, alibi_slopes: Any = None, **kwargs: Any) -> None:
        if alibi_slopes is not None:
            raise RuntimeError("no ALiBi here")
        super().__init__(*args, **kwargs)


class AbortingBackend(ReferenceBackend):
    """Dies (``os.abort``) on a slot past the cache's end, before any check: the
    ``bad_slot_range`` cell is a crash."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return AbortingImpl


class AbortingImpl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = AbortingBackend

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        slots = attn_metadata.slot_mapping
        if kv_cache.dim() == 5 and bool((slots >= kv_cache.shape[1] * kv_cache.shape[2]).any()):
            os.abort()
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)


class NoCacheWriteBackend(ReferenceBackend):
    """Answers right (from the batch's own keys) but never writes them into the cache: only
    the kit's check of the cache catches it."""

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return NoCacheWriteImpl


class NoCacheWriteImpl(ReferenceImpl):
    backend: ClassVar[type[AttentionBackend]] = NoCacheWriteBackend

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        count = attn_metadata.num_actual_tokens
        rows = self._attend(query[:count], key[:count], value[:count], kv_cache, attn_metadata)
        result = torch.empty(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype)
        result[:count] = rows.to(query.dtype)
        return result
