"""CPU_ATTN: paged attention on CPU, compiled decode and prefill kernels over pure-torch paths.

``softmax(q @ k^T * scale + mask) @ v`` (Vaswani et al. 2017) over each sequence's keys.
Four paths:

* every batch without autograd, on CPU: the compiled kernels read the paged cache in place
  through the block table (:mod:`attn_di.backends._cpu_kernel`), every feature: short causal
  queries (decode, chunked decode, speculative tokens: at most :data:`KERNEL_MAX_QUERY`
  tokens) through the decode kernel, every other sequence of the batch (prefill, chunked
  prefill, encoder attention) through the prefill kernel (flash attention on GEMM tiles).
  Unless it is unavailable or switched off (``ATTN_DI_CPU_KERNEL=0``); then the pure-torch
  paths below, which gather keys from the paged cache in cache-sized chunks whose results
  are merged exactly (online softmax / log-sum-exp):
* pure decode (one query per sequence, no window, no soft cap or ALiBi, no autograd, on
  CPU): whole cache blocks gathered per chunk straight into the fused CPU flash kernel,
  chunks merged once at the end (:meth:`CPUAttentionImpl._decode_flash`);
* otherwise without soft cap or ALiBi, and without autograd, on CPU: torch's fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``) with GQA folded into the query
  axis; sinks are applied from its log-sum-exp;
* otherwise: two float32 batched matmuls per chunk with the soft cap, ALiBi bias, mask and
  sinks applied to the scores.
"""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import torch

from attn_di.backend._backend import AttentionBackend
from attn_di.backend._metadata import AttentionMetadata
from attn_di.backends import _cpu_kernel
from attn_di.backends._common import (
    SeqGroup,
    alibi_bias,
    materialized,
    metadata_checked,
    uses_cache,
)
from attn_di.backends._grouped import GroupedAttentionImpl, TorchCPUBackend

__all__ = ["KERNEL_MAX_QUERY", "CPUAttentionBackend", "CPUAttentionImpl"]

#: Longest query (tokens per sequence) the compiled decode kernel takes (causal); longer ones
#: (prefills, compute-bound) go to the compiled prefill kernel, which runs on GEMM tiles.
KERNEL_MAX_QUERY = 16


class CPUAttentionBackend(TorchCPUBackend):
    """Paged attention in plain torch ops: every feature, any head or block size.

    Supports fp32/bf16/fp16 on CPU, sinks, sliding window, soft cap,
    ALiBi, GQA/MQA, decoder, encoder and encoder-only attention; mixed batches of prefill,
    chunked prefill and decode. Autograd flows through it (no in-place ops on inputs other
    than the cache write).
    """

    @staticmethod
    def get_name() -> str:
        """``"CPU_ATTN"``."""
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionImpl]:
        """:class:`CPUAttentionImpl`."""
        return CPUAttentionImpl

    @classmethod
    def supports_sink(cls) -> bool:
        """True: sinks join the softmax denominator."""
        return True


class CPUAttentionImpl(GroupedAttentionImpl):
    """The CPU_ATTN computation; see :class:`~attn_di.backend.AttentionImpl` for arguments."""

    backend: ClassVar[type[AttentionBackend]] = CPUAttentionBackend
    supports_alibi: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._workspaces = threading.local()
        self._kernel_options: tuple[Any, ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without scratch buffers (a thread-local cannot be)."""
        state = self.__dict__.copy()
        del state["_workspaces"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._workspaces = threading.local()

    @property
    def _workspace(self) -> _Workspace:
        """This thread's scratch buffers (one set per thread, so that threads sharing
        the impl, as in the transformers integration, never write into each other's)."""
        workspace: _Workspace | None = getattr(self._workspaces, "buffers", None)
        if workspace is None:
            workspace = self._workspaces.buffers = _Workspace()
        return workspace

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
        """See :meth:`GroupedAttentionImpl.forward`; same checks, same errors, same result.

        A model step's layers after the first (a decoder call whose metadata the full checks
        of an earlier call passed, unchanged since: :func:`metadata_checked`) write the cache
        and attend in one compiled call (:meth:`_one_call`), whose own checks of every input
        come before anything is written: the Python checks of each call cost more than a
        short decode's attention. Any input it refuses takes the checked path, which raises
        the error that names it.
        """
        if self._one_call(query, key, value, kv_cache, attn_metadata, output):
            assert output is not None
            return output
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)

    def _one_call(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor | None,
    ) -> bool:
        """The decoder step as one ``write_and_attend`` call where it applies (compiled
        kernels loaded, an ``output`` buffer, plain CPU tensors of a supported dtype without
        math bits, no gradient wanted, the metadata checked already); True if it ran."""
        fused = _cpu_kernel.write_and_attend_op()
        if fused is None or output is None or not uses_cache(self):
            return False
        # Written out rather than looped over: this runs once per layer call, and a
        # generator's set-up costs as much as the checks (docs/benchmarks.md).
        tensor = torch.Tensor
        if not (
            type(query) is tensor
            and type(key) is tensor
            and type(value) is tensor
            and type(kv_cache) is tensor
            and type(output) is tensor
            and query.dim() == 3
        ):
            return False
        # A tensor with a math bit (a negative or conjugate view, a zero tensor) reaches the op
        # as it is, not as a resolved copy: the op refuses it (a RuntimeError, below).
        if query.dtype not in self.backend.supported_dtypes or _wants_grad(
            query, key, value, kv_cache
        ):
            return False
        if not metadata_checked(self, kv_cache, metadata, query) or not metadata.seq_lens.shape[0]:
            return False
        try:
            self._run_kernel(fused, query, (kv_cache,), metadata, output, write=(key, value))
        except RuntimeError:
            return False  # refused before any write: the checked path says why
        return True

    def _write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """One compiled call (``torch.ops.attn_di.write_kv_cache``) where it applies: CPU,
        rows contiguous in their last dimension, no gradient wanted; else the torch path."""
        op = _cpu_kernel.write_kv_cache_op()
        if (
            op is None
            or _wants_grad(key, value, kv_cache)
            or key.device.type != "cpu"
            or key.stride(-1) != 1
            or value.stride(-1) != 1
            or _has_math_bit(kv_cache)  # a negative view: written through torch's own ops
        ):
            super()._write_kv_cache(key, value, kv_cache, slot_mapping)
            return
        op(_resolved(key), _resolved(value), kv_cache[0], kv_cache[1], _resolved(slot_mapping))

    def _forward_fast(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor,
    ) -> bool:
        """The compiled kernels where they apply (:meth:`_run_kernel`; without a cache, over
        the batch's own keys, :meth:`_encoder_kernel`), else pure decode batches
        :meth:`_decode_flash`; everything else the grouped path."""
        cached = uses_cache(self)
        if _kernel_applies(query, kv_cache if cached else key, metadata):
            kernel = _cpu_kernel.paged_attention_op()
            if kernel is not None:
                if cached:
                    self._run_kernel(kernel, query, (kv_cache[0], kv_cache[1]), metadata, rows)
                else:
                    self._encoder_kernel(kernel, query, key, value, metadata, rows)
                return True
        if cached and _is_pure_decode(self, query, kv_cache, metadata):
            self._decode_flash(query, kv_cache, metadata, rows)
            return True
        return False

    def _encoder_kernel(
        self,
        kernel: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor,
    ) -> None:
        """Encoder attention (no cache, bidirectional) through the compiled kernels: the
        batch's keys and values are a cache of one-token blocks, token ``t`` block ``t``, and
        sequence ``b``'s block table lists its own tokens."""
        starts = metadata.query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]
        width = int(q_lens.max()) if q_lens.numel() else 0
        table = starts[:-1, None] + torch.arange(width, device=starts.device)[None, :]
        encoder = AttentionMetadata(
            num_actual_tokens=metadata.num_actual_tokens,
            max_query_len=width,
            query_start_loc=metadata.query_start_loc,
            max_seq_len=width,
            seq_lens=q_lens,
            block_table=table,
            slot_mapping=metadata.slot_mapping,
            causal=False,
        )
        self._run_kernel(kernel, query, (key.unsqueeze(1), value.unsqueeze(1)), encoder, rows)

    def _run_kernel(
        self,
        kernel: Any,
        query: torch.Tensor,
        caches: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        rows: torch.Tensor,
        write: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Attention of every query straight from the paged cache into ``rows``, compiled.

        ``kernel`` is ``torch.ops.attn_di.paged_attention`` and ``caches`` its
        ``(key_cache, value_cache)``, ``[num_blocks, block_size, H_kv, D]`` planes. It reads
        only the slots of positions each query may see, so garbage elsewhere in the cache
        never reaches ``rows``. The fixed layer options are converted once per impl; the
        sinks are passed as they are on every call (the kernel reads them as float32), so
        in-place updates (``load_state_dict``, ``sinks.fill_``) reach it.

        With ``write`` (``(key, value)``, ``[N, H_kv, D]``), ``kernel`` is
        ``torch.ops.attn_di.write_and_attend``, ``caches`` ``(kv_cache,)`` (the layer's
        ``[2, num_blocks, block_size, H_kv, D]`` cache, whose planes the op takes itself) and
        ``rows`` the ``[N, H * D]`` output: the first ``metadata.num_actual_tokens`` keys and
        values go to their slots first (:meth:`_one_call`).
        """
        if self._kernel_options is None:
            alibi = self.alibi_slopes
            self._kernel_options = (
                self.scale,
                self.sliding_window or 0,
                self.logits_soft_cap or 0.0,
                None if alibi is None else torch.tensor(alibi, dtype=torch.float32),
            )
        sinks = None if self.sinks is None else self.sinks.detach()
        if write is not None:  # the one-call lane: the op refuses math bits (_one_call)
            kernel(
                query,
                *write,
                *caches,
                metadata.slot_mapping,
                metadata.num_actual_tokens,
                metadata.block_table,
                metadata.seq_lens,
                metadata.query_start_loc,
                rows,
                *self._kernel_options,
                sinks,
                bool(metadata.causal),
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
            )
            return
        # The kernel writes rows whose last dimension is contiguous; any other ``output=``
        # (or a negative view) gets a contiguous copy (padding rows kept as they were), copied
        # back after. The ops refuse math bits: the checked path hands them resolved tensors.
        target = rows.resolve_neg()
        if target.stride(-1) != 1:
            target = target.contiguous()
        kernel(
            _resolved(query),
            *map(_resolved, caches),
            _resolved(metadata.block_table),
            _resolved(metadata.seq_lens),
            _resolved(metadata.query_start_loc),
            target,
            *self._kernel_options,
            None if sinks is None else _resolved(sinks),
            bool(metadata.causal),
        )
        if target is not rows:
            rows.copy_(target)

    def _decode_flash(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor,
    ) -> None:
        """Pure decode (one query per sequence) straight from the block table into ``rows``.

        Whole cache blocks (one contiguous row of ``block_size * H_kv * D`` values each) are
        gathered with ``index_select`` into two small reused buffers, sized to stay in the
        core's L2/L3 cache (:data:`_DECODE_CHUNK_BYTES`), and handed at once to torch's CPU
        flash kernel with GQA folded (``[b, H_kv, g, D]`` queries), so the kernel reads the
        copy from cache rather than from memory. A chunk is ``s`` sequences by ``c`` block
        columns of the block table. Keys past a sequence's length are masked, and their
        gathered rows (the slots past its end in its last block, and the blocks its unused
        block-table entries name) are zeroed: a masked key's probability is 0, and 0 times
        the NaN or Inf a slot may hold, or another sequence's infinite value, is NaN. The chunks'
        results are merged once at the end through their log-sum-exps (softmax over the
        chunk axis), and sinks scale the result by ``sigmoid(lse - sink)``.
        """
        kv_heads, per_kv, size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        seqs = int(metadata.seq_lens.shape[0])
        block_size = int(kv_cache.shape[2])
        dtype, device = query.dtype, query.device
        seq_lens = metadata.seq_lens.to(device=device, dtype=torch.long)
        max_len = int(seq_lens.max())
        table_cols = -(-max_len // block_size)
        table = metadata.block_table[:, :table_cols].to(device=device, dtype=torch.long)
        needed = -(-seq_lens // block_size)
        col = torch.arange(table_cols, device=device)
        # Unused entries name the longest sequence's first block (a block of this cache;
        # block 0 may be unallocated), whose gathered rows are zeroed below.
        longest = int(seq_lens.argmax())
        table = torch.where(col[None, :] < needed[:, None], table, table[longest, 0])
        block_numel = block_size * kv_heads * size
        group, cols = _decode_chunk(seqs, table_cols, block_size, 4 * block_numel)
        # Keys and values in one gather from the blocks' rows (_block_rows).
        kv_rows, key_step, value_first = _block_rows(kv_cache)
        kv_table = torch.stack((table * key_step, table * key_step + value_first))  # [2, B, cols]
        buffer = self._workspace.get("decode_kv", 2 * group * cols * block_numel, dtype, device)
        queries = query[:seqs].reshape(seqs, kv_heads, per_kv, size)
        ragged = bool((seq_lens != needed * block_size).any()) or bool((needed != table_cols).any())
        key_pos = torch.arange(table_cols * block_size, device=device)
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        for first in range(0, seqs, group):
            last = min(seqs, first + group)
            group_outs: list[torch.Tensor] = []
            group_lses: list[torch.Tensor] = []
            for start in range(0, table_cols, cols):
                stop = min(table_cols, start + cols)
                index = kv_table[:, first:last, start:stop].reshape(-1)
                gathered = buffer[: index.numel() * block_numel].view(-1, block_numel)
                torch.index_select(kv_rows, 0, index, out=gathered)
                keys, values = gathered.view(2, -1)
                width = (stop - start) * block_size
                shape = (last - first, width, kv_heads, size)
                mask = valid = None
                if ragged:
                    valid = key_pos[start * block_size : stop * block_size]
                    valid = valid[None, :] < seq_lens[first:last, None]
                    past_end = (~valid).view(-1).nonzero().view(-1)  # rows, sequence-major
                    gathered.view(2, (last - first) * width, -1).index_fill_(1, past_end, 0)
                    mask = _additive_mask(valid, dtype)[:, None, None, :]
                    mask = mask.expand(-1, 1, per_kv, -1)
                out, lse = _chunk_attention(
                    queries[first:last],
                    keys.view(shape).transpose(1, 2),
                    values.view(shape).transpose(1, 2),
                    mask,
                    self.scale,
                )
                if valid is not None:  # a sequence that ends before the chunk: weight 0
                    lse = _unreached(lse, valid.any(-1)[:, None, None])
                group_outs.append(out)
                group_lses.append(lse)
            outs.append(torch.stack(group_outs))
            lses.append(torch.stack(group_lses))
        out_all = torch.cat(outs, 1).float()  # [chunks, B, H_kv, g, D]
        lse_all = torch.cat(lses, 1).float()  # [chunks, B, H_kv, g]
        if len(group_outs) == 1:
            acc, lse = out_all[0], lse_all[0]
        else:
            lse = torch.logsumexp(lse_all, 0)
            weights = torch.exp(lse_all - lse).unsqueeze(-1)
            # A chunk a sequence does not reach has weight 0; its output may be garbage.
            terms = out_all * weights
            if ragged:  # weight 0 only: a NaN weight (a NaN log-sum-exp) stays NaN
                terms = torch.where(weights == 0, 0.0, terms)
            acc = terms.sum(0)
        sinks = None if self.sinks is None else self.sinks.float().view(1, kv_heads, per_kv, 1)
        acc = _finish_rows(acc, lse.unsqueeze(-1), sinks)
        rows[:seqs] = acc.view(seqs, self.num_heads, size).to(rows.dtype)

    def _attend(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, H, Lq, D]`` (a view of :meth:`_attend_rows`)."""
        return self._attend_rows(query, key_src, value_src, group).transpose(1, 2)

    def _attend_rows(
        self,
        query: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, Lq, H, D]`` float32 attention of one group, over key chunks.

        Keys are visited in chunks of :func:`_chunk_len` tokens with the online-softmax
        recurrence of Milakov & Gimelshein 2018 ("Online normalizer calculation for
        softmax"), so gathered keys/values stay cache-sized and buffers are reused.
        """
        if _use_flash_kernel(self, query, key_src, value_src):
            queries = query[group.query_index]  # [b, Lq, H, D], padding rows repeat row 0
            if _finite_queries(queries):
                return self._attend_flash(queries, key_src, value_src, group)
        kv_heads, per_kv, size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        seqs, q_len = group.query_index.shape
        k_len = int(group.kv_index.shape[1])
        rows, batch = per_kv * q_len, kv_heads * seqs
        queries = query[group.query_index].float()  # [b, Lq, H, D]
        queries = queries.view(seqs, q_len, kv_heads, per_kv, size).permute(2, 0, 3, 1, 4)
        queries = (queries * self.scale).reshape(batch, rows, size)
        if self.sinks is not None:
            sinks = self.sinks.float().view(kv_heads, 1, per_kv, 1, 1)
            peak = sinks.expand(kv_heads, seqs, per_kv, q_len, 1).reshape(batch, rows, 1)
            denom = torch.ones(batch, rows, 1)
        else:
            peak = torch.full((batch, rows, 1), float("-inf"))
            denom = torch.zeros(batch, rows, 1)
        acc = torch.zeros(batch, rows, size)
        bias = None
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, group).view(seqs, kv_heads, per_kv, q_len, k_len)
            bias = bias.transpose(0, 1)
        chunk = min(_chunk_len(seqs, kv_heads, size, rows), k_len)
        gather = _HeadMajorGather(key_src, value_src, seqs, chunk, self._workspace)
        for start in range(0, k_len, chunk):
            stop = min(k_len, start + chunk)
            width = stop - start
            k_mat, v_mat = gather(group.kv_index[:, start:stop])  # [H_kv * b, width, D] fp32
            scores = torch.bmm(queries, k_mat.transpose(1, 2))  # [H_kv * b, g * Lq, width]
            scores5 = scores.view(kv_heads, seqs, per_kv, q_len, width)
            if self.logits_soft_cap is not None:
                cap = self.logits_soft_cap
                scores5 = torch.tanh(scores5 / cap) * cap
            if bias is not None:
                scores5 = scores5 + bias[..., start:stop]
            allowed = group.allowed[None, :, None, :, start:stop]
            scores5 = scores5.masked_fill(~allowed, float("-inf"))
            scores = scores5.reshape(batch, rows, width)
            new_peak = torch.maximum(peak, scores.amax(dim=-1, keepdim=True))
            safe_peak = torch.where(torch.isfinite(new_peak), new_peak, 0.0)
            weights = torch.exp(scores - safe_peak)
            rescale = torch.exp(peak - safe_peak)
            denom = denom * rescale + weights.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.bmm(weights, v_mat)
            peak = new_peak
        # denom >= 1 wherever a score or a finite sink is the maximum; 0 where every visible
        # score is -inf and no finite sink: NaN then, as the reference's softmax (a where, not
        # 0 / 0, so that the padding rows, which see no key, pass no NaN to the gradients).
        tiny = torch.finfo(torch.float32).tiny
        attended = torch.where(denom > 0, acc / denom.clamp_min(tiny), float("nan"))
        attended = attended.view(kv_heads, seqs, per_kv, q_len, size).permute(1, 3, 0, 2, 4)
        return attended.reshape(seqs, q_len, self.num_heads, size)

    def _attend_flash(
        self,
        queries: torch.Tensor,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        group: SeqGroup,
    ) -> torch.Tensor:
        """``[b, Lq, H, D]`` float32 attention of one group through torch's CPU flash kernel;
        ``queries`` are the group's ``[b, Lq, H, D]`` query rows (``query[group.query_index]``).

        GQA is folded into the query axis: the g query heads of a KV head become g * Lq
        query rows against that KV head, each row carrying its query's mask row. Keys are
        gathered token-major in cache-sized chunks and passed as strided views; the chunks'
        results are merged exactly through their log-sum-exps
        (``out = sum_c out_c * exp(lse_c - lse)``, ``lse = logsumexp_c lse_c``), and sinks
        scale the result by ``sigmoid(lse - sink)``.
        """
        kv_heads, per_kv, size = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        seqs, q_len = (int(n) for n in group.query_index.shape)
        k_len, rows = int(group.kv_index.shape[1]), per_kv * q_len
        dtype = queries.dtype
        queries = queries.view(seqs, q_len, kv_heads, per_kv, size)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(seqs, kv_heads, rows, size)
        chunk = min(k_len, max(16, _CHUNK_BYTES // (16 * seqs * kv_heads * size)))
        count = seqs * chunk * kv_heads * size
        key_buf = self._workspace.get("flash_keys", count, dtype, queries.device)
        value_buf = self._workspace.get("flash_values", count, dtype, queries.device)
        acc: torch.Tensor | None = None
        lse = torch.empty(0)
        for start in range(0, k_len, chunk):
            stop = min(k_len, start + chunk)
            width = stop - start
            index = group.kv_index[:, start:stop].reshape(-1)
            keys = key_buf[: seqs * width * kv_heads * size].view(seqs * width, kv_heads, size)
            values = value_buf[: keys.numel()].view_as(keys)
            torch.index_select(key_src, 0, index, out=keys)
            torch.index_select(value_src, 0, index, out=values)
            allowed = group.allowed[:, None, None, :, start:stop]
            mask = _additive_mask(allowed, dtype)
            mask = mask.expand(seqs, 1, per_kv, q_len, width).reshape(seqs, 1, rows, width)
            out, chunk_lse = _chunk_attention(
                queries,
                keys.view(seqs, width, kv_heads, size).transpose(1, 2),
                values.view(seqs, width, kv_heads, size).transpose(1, 2),
                mask,
                self.scale,
            )
            chunk_lse = chunk_lse.float()  # [b, H_kv, g * Lq]
            reached = allowed.any(-1).expand(seqs, 1, per_kv, q_len).reshape(seqs, 1, rows)
            if not bool(reached.all()):  # rows that see no key of this chunk: weight 0, out 0
                chunk_lse = _unreached(chunk_lse, reached)
                out = torch.where(reached[..., None], out, 0.0)
            chunk_lse = chunk_lse.unsqueeze(-1)
            if acc is None:
                acc, lse = out.float(), chunk_lse
            else:
                merged = torch.logaddexp(lse, chunk_lse)
                finite = torch.where(torch.isfinite(merged), merged, 0.0)  # -inf: nothing yet
                acc = acc * torch.exp(lse - finite) + out.float() * torch.exp(chunk_lse - finite)
                lse = merged
        assert acc is not None
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks.float().view(1, kv_heads, per_kv, 1).expand(1, -1, -1, q_len)
            sinks = sinks.reshape(1, kv_heads, rows, 1)
        acc = _finish_rows(acc, lse, sinks)
        acc = acc.view(seqs, kv_heads, per_kv, q_len, size).permute(0, 3, 1, 2, 4)
        return acc.reshape(seqs, q_len, self.num_heads, size)


# torch's fused CPU flash-attention op, which also returns the log-sum-exp; private API,
# so CPU_ATTN falls back to its own matmuls when it is missing.
_FLASH_FOR_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``-inf`` elsewhere, in ``dtype``: the fused kernel adds it to
    float32 scores, so any finite value (``finfo(float16).min`` is -65504) could outscore
    real scores below it."""
    return torch.where(allowed, 0.0, float("-inf")).to(dtype)


def _chunk_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one key chunk: ``out`` ``[b, H_kv, rows, D]`` in the query dtype,
    ``lse`` ``[b, H_kv, rows]`` float32, for ``queries`` ``[b, H_kv, rows, D]``, ``keys`` and
    ``values`` ``[b, H_kv, width, D]`` and an additive ``mask`` ``[b, 1, rows, width]`` (or
    None).

    torch's CPU flash kernel where every key is finite. Where one is not, the same softmax
    written out in float32: that kernel gives a row whose scores are all -inf (an infinite
    key against a query of the other sign) an output of 0 and a log-sum-exp of 0, which the
    chunk merge would count as a key of score 0, and in bfloat16 / float16 it turns a +inf
    score into a finite row. Here such a row gets a log-sum-exp of -inf and an output of 0
    (weight 0 in the merge, :func:`_finish_rows` after it), and a +inf or NaN score makes
    its row NaN, as in the float64 reference.
    """
    if bool(torch.isfinite(keys).all()):
        out, lse = _FLASH_FOR_CPU(queries, keys, values, attn_mask=mask, scale=scale)
        return out, lse
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
    out = out.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0)
    return out.to(queries.dtype), lse


def _finish_rows(acc: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The merged rows ``acc`` (``[..., D]`` float32, log-sum-exps ``lse`` ``[..., 1]``) with
    the sinks applied (``sinks`` broadcastable to ``lse``: ``acc * sigmoid(lse - sink)``).

    A row whose every visible score was -inf (``lse`` -inf: every query row sees a key) is
    NaN, as the float64 reference's softmax (-inf - -inf), or 0 where its head has a finite
    sink, which then takes all the weight.
    """
    dead = lse == float("-inf")
    acc = acc.masked_fill(dead, float("nan"))
    if sinks is None:
        return acc
    acc = acc * torch.sigmoid(lse - sinks)
    return acc.masked_fill(dead & (sinks > float("-inf")), 0.0)


def _unreached(lse: torch.Tensor, reached: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` for the rows that see no key (``reached`` False): torch's CPU
    flash kernel gives such rows an output of 0 and a log-sum-exp of 0, which would weigh
    them as one key of score 0 when chunks are merged."""
    return torch.where(reached, lse, float("-inf"))


def _use_flash_kernel(
    impl: CPUAttentionImpl, query: torch.Tensor, key_src: torch.Tensor, value_src: torch.Tensor
) -> bool:
    """Whether the fused kernel can run this call: no score modifier, no autograd, on CPU
    (the queries it attends must also be finite: :func:`_finite_queries`)."""
    if _FLASH_FOR_CPU is None or query.device.type != "cpu":
        return False
    if impl.logits_soft_cap is not None or impl.alibi_slopes is not None:
        return False
    return not _wants_grad(query, key_src, value_src)


def _finite_queries(queries: torch.Tensor) -> bool:
    """Whether every value of the query rows a call attends (padding tokens left out) is
    finite, as torch's CPU flash kernel needs them.

    Given fewer than 16 keys and no mask, that kernel takes a row whose scores are all NaN
    (a NaN query, or an infinite one against keys of both signs) for a row that sees no key:
    output 0 and a log-sum-exp of 0, a finite result where the float64 reference's softmax
    is NaN. Such a query takes the explicit softmax instead
    (:meth:`CPUAttentionImpl._attend_rows`), whose maxima and exponentials carry the NaN.
    One reduction over the queries a call.
    """
    return bool(torch.isfinite(queries).all())


def _kernel_applies(query: torch.Tensor, keys: torch.Tensor, metadata: AttentionMetadata) -> bool:
    """Whether the compiled kernels may run this call (if they are loaded): any batch whose
    keys (the cache, or the batch's own keys without one) are in the query's dtype, all on
    CPU, with no gradient wanted (the kernels record no autograd history)."""
    if query.device.type != "cpu" or keys.dtype != query.dtype or not metadata.num_seqs:
        return False
    return not _wants_grad(query, keys)


def _has_math_bit(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a negative or conjugate view or a zero tensor, which the compiled
    ops refuse (they see such tensors as the caller holds them)."""
    return tensor.is_neg() or tensor.is_conj() or tensor._is_zerotensor()


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values without a math bit: itself where it has none (no copy), else a
    copy (a zero tensor's zeros, :func:`materialized`; a negative or conjugate view's values)."""
    return materialized(tensor).resolve_neg().resolve_conj()


def _wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``tensors`` (grad mode on, one requires grad):
    the compiled ops and torch's fused flash kernel record nothing, so they are skipped."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def _is_pure_decode(
    impl: CPUAttentionImpl,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> bool:
    """Whether :meth:`CPUAttentionImpl._decode_flash` can run this call.

    Every sequence has exactly one query token (its last position, so causality masks
    nothing), there is no sliding window, the fused kernel is usable and the cache is in
    the query's dtype.
    """
    seqs = int(metadata.seq_lens.shape[0])
    if not seqs or metadata.max_query_len != 1 or metadata.num_actual_tokens != seqs:
        return False
    if impl.sliding_window is not None or kv_cache.dtype != query.dtype:
        return False
    if not _token_major_blocks(kv_cache):
        return False
    if not _use_flash_kernel(impl, query, kv_cache, kv_cache) or not _finite_queries(query[:seqs]):
        return False
    starts = metadata.query_start_loc
    return int(starts[-1]) == seqs and bool((starts[1:] - starts[:-1] == 1).all())


def _token_major_blocks(kv_cache: torch.Tensor) -> bool:
    """Whether each cache block is one contiguous ``[block_size, H_kv, D]`` array (token rows
    of all heads, one after another), as :meth:`CPUAttentionImpl._decode_flash` gathers it."""
    _, _, block_size, kv_heads, size = kv_cache.shape
    _, _, token_stride, head_stride, _ = kv_cache.stride()
    return head_stride == size and (token_stride == kv_heads * size or block_size == 1)


def _block_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(rows, key_step, value_first)``: the cache's blocks as rows of ``block_numel`` values.

    Key block b is row ``b * key_step``, value block b row ``value_first + b * key_step``: the
    rows are ``u`` elements apart, ``u`` the greatest common divisor of the block stride and
    the offset of the value plane, so one view (rows may overlap; they are only read) serves
    attn_di's layout (``[2, num_blocks, ...]``: key block b is row b, value block b row
    ``num_blocks + b``) and vLLM's blocks-outermost one (``[num_blocks, 2, ...]``: rows 2b and
    2b + 1). Needs :func:`_token_major_blocks`.
    """
    num_blocks = int(kv_cache.shape[1])
    block_numel = int(kv_cache[0, 0].numel())
    plane_stride, block_stride = kv_cache.stride(0), kv_cache.stride(1)
    unit = math.gcd(plane_stride, block_stride if num_blocks > 1 else 0) or 1
    key_step, value_first = block_stride // unit, plane_stride // unit
    count = value_first + (num_blocks - 1) * key_step + 1 if num_blocks else 0
    rows = kv_cache.as_strided((count, block_numel), (unit, 1), kv_cache.storage_offset())
    return rows, key_step, value_first


# Bytes of keys per decode chunk, counted as float32 (so half that in bf16/fp16 caches),
# plus as many of values: small enough that the copy is still in cache when the kernel
# reads it, large enough to keep the op count low (each op is a parallel region).
# Tuned on the 2-core benchmark machine (docs/benchmarks-backends.md).
_DECODE_CHUNK_BYTES = 4 << 20
# Keys per sequence per chunk, at least: fewer, longer rows per kernel call.
_DECODE_MIN_KEYS = 256


def _decode_chunk(seqs: int, table_cols: int, block_size: int, block_bytes: int) -> tuple[int, int]:
    """``(sequences, block columns)`` per decode chunk, about :data:`_DECODE_CHUNK_BYTES`.

    ``block_bytes`` is the size of one block of keys in float32.

    Each sequence contributes at least :data:`_DECODE_MIN_KEYS` keys to a chunk (fewer,
    longer rows per kernel call); the rest of the budget goes to more sequences.
    """
    blocks = max(1, _DECODE_CHUNK_BYTES // block_bytes)
    cols = min(table_cols, max(1, -(-_DECODE_MIN_KEYS // block_size), blocks // seqs))
    group = max(1, min(seqs, blocks // cols))
    return group, cols


class _HeadMajorGather:
    """Gathers key/value chunks from a token-major source into reused head-major buffers.

    The source is ``[S, H_kv, D]`` (cache slots or tokens); a chunk of ``b`` sequences by
    ``w`` keys comes out as float32 ``[H_kv * b, w, D]``, ready for ``torch.bmm``. float32
    sources are gathered row by row (``D`` contiguous values) straight into head-major
    order; other dtypes are gathered token by token, then transposed and up-cast in one copy.
    Buffers are allocated once per group, so no chunk pays for fresh pages.
    """

    def __init__(
        self,
        key_src: torch.Tensor,
        value_src: torch.Tensor,
        seqs: int,
        chunk: int,
        workspace: _Workspace,
    ) -> None:
        self.key_src, self.value_src = key_src, value_src
        self.seqs = seqs
        self.kv_heads, self.size = int(key_src.shape[1]), int(key_src.shape[2])
        # Head rows straight from the source need [H_kv, D] token rows (a flat view of D rows).
        self.direct = key_src.dtype == torch.float32 and all(
            src.stride(1) == self.size and src.stride(0) == self.kv_heads * self.size
            for src in (key_src, value_src)
        )
        count = self.kv_heads * seqs * chunk * self.size
        device = key_src.device
        self.keys = workspace.get("keys", count, torch.float32, device).view(-1, self.size)
        self.values = workspace.get("values", count, torch.float32, device).view(-1, self.size)
        if not self.direct:
            staged = workspace.get("staged", count, key_src.dtype, device)
            self.staged = staged.view(seqs * chunk, self.kv_heads, self.size)
        self.head_offsets = torch.arange(self.kv_heads, device=key_src.device)[:, None]

    def __call__(self, kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``kv_index`` (``[b, w]`` source rows), float32 head-major."""
        width = int(kv_index.shape[1])
        count = self.kv_heads * self.seqs * width
        batch = self.kv_heads * self.seqs
        keys, values = self.keys[:count], self.values[:count]
        if self.key_src.requires_grad or self.value_src.requires_grad:
            # out= ops do not record autograd: gather out of place when gradients flow.
            rows = (kv_index.reshape(1, -1) * self.kv_heads + self.head_offsets).reshape(-1)
            keys = self.key_src.reshape(-1, self.size)[rows].float()
            values = self.value_src.reshape(-1, self.size)[rows].float()
        elif self.direct:
            rows = (kv_index.reshape(1, -1) * self.kv_heads + self.head_offsets).reshape(-1)
            heads = self.key_src.shape[0] * self.kv_heads
            for src, dst in ((self.key_src, keys), (self.value_src, values)):
                flat = src.as_strided((heads, self.size), (self.size, 1), src.storage_offset())
                torch.index_select(flat, 0, rows, out=dst)
        else:
            index = kv_index.reshape(-1)
            staged = self.staged[: self.seqs * width]
            shape = (self.seqs, width, self.kv_heads, self.size)
            for src, dst in ((self.key_src, keys), (self.value_src, values)):
                torch.index_select(src, 0, index, out=staged)
                dst.view(self.kv_heads, self.seqs, width, self.size).copy_(
                    staged.view(shape).permute(2, 0, 1, 3)
                )
        return keys.view(batch, width, self.size), values.view(batch, width, self.size)


class _Workspace:
    """Scratch buffers kept between calls, so that steady-state decode allocates no pages.

    Each named buffer grows to the largest size asked for and is then reused; an impl keeps
    one workspace per thread (:attr:`CPUAttentionImpl._workspace`), so concurrent forwards
    on one impl never share a buffer.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (contents undefined)."""
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel]


# Bytes of float32 keys gathered per chunk: within a server CPU's L3 cache, and few chunks
# (few ops) per call, which matters most when cores are shared.
_CHUNK_BYTES = 16 << 20


def _chunk_len(seqs: int, kv_heads: int, size: int, rows: int) -> int:
    """Keys per chunk so that one chunk of keys (and of scores) fits :data:`_CHUNK_BYTES`."""
    per_key = 4 * seqs * kv_heads * max(size, rows)
    return max(16, _CHUNK_BYTES // per_key)
