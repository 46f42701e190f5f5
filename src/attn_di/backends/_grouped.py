"""The forward pass shared by attn_di's computing backends: check, write the cache, then attend
group by group (sequences of similar length batched, see :class:`BatchPlan`)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from attn_di.backend._backend import AttentionBackend
from attn_di.backend._impl import AttentionImpl
from attn_di.backend._metadata import AttentionMetadata
from attn_di.backend._types import AttentionType
from attn_di.backends._common import (
    BatchPlan,
    CacheRows,
    SeqGroup,
    cache_rows,
    check_inputs,
    materialized,
    new_output,
    uses_cache,
    write_kv_cache,
)

__all__ = ["GroupedAttentionImpl", "TorchCPUBackend"]


class TorchCPUBackend(AttentionBackend):
    """What attn_di's torch backends have in common: fp32/bf16/fp16; decoder, encoder and
    encoder-only attention; autograd (FLEX_ATTENTION turns it off); the CPU only (the ops are
    device-generic, but no GPU was tested)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_attn_types: ClassVar[tuple[str, ...]] = (
        AttentionType.DECODER,
        AttentionType.ENCODER,
        AttentionType.ENCODER_ONLY,
    )
    supports_backward: ClassVar[bool] = True
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)


class GroupedAttentionImpl(AttentionImpl):
    """An impl whose backend attends one :class:`SeqGroup` at a time (:meth:`_attend`)."""

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
        query, key, value = materialized(query), materialized(key), materialized(value)
        result = new_output(query, output)
        actual = attn_metadata.num_actual_tokens
        cache: CacheRows | None = None
        if uses_cache(self):
            self._write_kv_cache(key[:actual], value[:actual], kv_cache, attn_metadata.slot_mapping)
        rows = result.view(-1, self.num_heads, self.head_size)
        if self._forward_fast(query, key, value, kv_cache, attn_metadata, rows):
            return result
        if uses_cache(self):
            cache = cache_rows(kv_cache)
            key_src, value_src = cache.keys, cache.values
        else:
            key_src, value_src = key, value
        for group in BatchPlan(self, attn_metadata, cache).groups():
            attended = self._attend(query, key_src, value_src, group)  # [b, H, Lq, D]
            attended = attended.transpose(1, 2)[group.query_valid]
            rows[group.query_index[group.query_valid]] = attended.to(result.dtype)
        return result

    def _write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the step's keys/values at their slots (:func:`write_kv_cache`); a backend
        with a faster way overrides this."""
        write_kv_cache(key, value, kv_cache, slot_mapping)

    def _forward_fast(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor,
    ) -> bool:
        """A backend's special path for the whole batch (after the cache write): True if it
        filled ``rows`` ``[num_tokens, H, D]`` itself. None by default.

        ``key``/``value`` are the batch's ``[num_tokens, H_kv, D]`` (the keys themselves
        where the attention type has no cache)."""
        return False

    @abc.abstractmethod
    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, H, Lq, D]`` attention of one group, in the query's dtype.

        Args:
            query: ``[num_tokens, H, D]``, all of the batch's queries.
            key_src, value_src: ``[rows, H_kv, D]``: the cache's rows (:class:`CacheRows`;
                ``group.kv_index`` names them), or the new keys/values themselves when there
                is no cache. Any strides: gather rows, never reshape them.
            group: which query rows and key slots belong to the group's sequences.
        """
