"""Per-batch attention metadata (vLLM's common fields) and the builder that makes it."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_di.exceptions import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionMetadata", "AttentionMetadataBuilder"]


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
"""The range of the metadata's int32 tensors (lengths, block numbers, query_start_loc)."""


def _integers(argument: str, value: object, expected: str) -> torch.Tensor:
    """``value`` as an int64 tensor of numbers that fit int32 (the metadata's index type);
    refuses floats (``[1.5]``), bools and non-numbers, and names the first entry outside
    int32 with the value the caller gave (``2**32 + 3`` would become block 3)."""
    import torch

    hint = f"expected {expected}"
    _SIGNED = tuple(getattr(torch, name) for name in _SIGNED_NAMES)  # noqa: N806
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        found = _first_outside_int32(value)
        if found is not None:
            raise _outside_int32(argument, *found) from None
        raise InvalidInputError(
            argument, f"must be integers, got {value!r} ({type(value).__name__})", hint=hint
        ) from None
    unsigned = tuple(getattr(torch, f"uint{bits}", None) for bits in (16, 32, 64))
    if tensor.dtype is unsigned[2]:  # values past int64's range: compare them exactly
        for index, number in _entries(tensor.tolist(), ()):
            if not _INT32_MIN <= number <= _INT32_MAX:
                raise _outside_int32(argument, index, number)
    elif tensor.dtype not in (*_SIGNED, torch.uint8, *unsigned) and tensor.numel():
        # torch.as_tensor([]) is float32: an empty list is fine
        raise InvalidInputError(
            argument, f"must be integers, got {tensor.tolist()} ({tensor.dtype})", hint=hint
        )
    result = tensor.to(torch.int64)
    outside = (result < _INT32_MIN) | (result > _INT32_MAX)
    if bool(outside.any()):
        index = tuple(int(i) for i in outside.nonzero()[0])
        raise _outside_int32(argument, index, int(result[index]))
    return result


_SIGNED_NAMES = ("int8", "int16", "int32", "int64")


def _first_outside_int32(value: object) -> tuple[tuple[int, ...], int] | None:
    """``(index, number)`` of the first int of nested sequences ``value`` outside int32."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return None
    for index, number in _entries(value, ()):
        if isinstance(number, int) and not _INT32_MIN <= number <= _INT32_MAX:
            return index, number
    return None


def _entries(value: object, index: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Any]]:
    """``(index, leaf)`` of every leaf of nested sequences, in order."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for position, item in enumerate(value):
            yield from _entries(item, (*index, position))
    else:
        yield index, value


def _outside_int32(argument: str, index: tuple[int, ...], number: int) -> InvalidInputError:
    """The error naming entry ``index`` of ``argument``, whose ``number`` does not fit int32."""
    where = f"[{', '.join(map(str, index))}]" if index else ""
    if argument == "block_table":
        kind = "block numbers"
        hint = (
            f"block numbers index the KV cache's axis 1: 0 to {_INT32_MAX} (negative numbers "
            "only as padding past a sequence's blocks)"
        )
    else:
        kind, hint = "lengths", f"{argument} counts tokens: 0 to {_INT32_MAX}"
    return InvalidInputError(
        argument,
        f"{argument}{where} = {number} does not fit int32, in which the metadata holds "
        f"{kind} ({_INT32_MIN} to {_INT32_MAX}): it would wrap to another number",
        hint=hint,
    )


@dataclass
class AttentionMetadata:
    """What one forward pass needs to know about the batch; B sequences, N tokens.

    Field names and meaning follow vLLM v1's ``CommonAttentionMetadata``. The query tokens
    of sequence ``i`` are its last ``query_len_i`` positions, stored in
    ``query[query_start_loc[i]:query_start_loc[i + 1]]``.

    Attributes:
        num_actual_tokens: N, the number of real (unpadded) query tokens.
        max_query_len: the longest query length in the batch.
        query_start_loc: ``[B + 1]`` int32, cumulative query lengths starting at 0.
        max_seq_len: the longest sequence length (cached prefix + query) in the batch.
        seq_lens: ``[B]`` int32, each sequence's length including its query tokens.
        block_table: ``[B, max_blocks]`` int32, the cache block numbers of each sequence,
            in position order (position ``p`` lives in block ``block_table[i, p // block_size]``).
        slot_mapping: ``[N]`` int64, each query token's cache slot
            (``block_number * block_size + offset``); negative means padding, not written.
        causal: whether queries see only keys at or before their own position.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences."""
        return int(self.seq_lens.shape[0])

    def query_lens(self) -> torch.Tensor:
        """``[B]`` int64: each sequence's number of query tokens."""
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()


class AttentionMetadataBuilder:
    """Makes :class:`AttentionMetadata` from per-sequence lengths and a block table.

    Args:
        block_size: tokens per KV-cache block (the cache's axis 2).
        device: where the metadata tensors live (``"cpu"`` by default).

    Raises:
        InvalidInputError: ``block_size`` is not a positive int (at most ``2**31 - 1``), or
            ``device`` is not a torch device (``torch.device(device)`` refuses it).
    """

    def __init__(self, block_size: int, device: str | torch.device = "cpu") -> None:
        size = None
        if not isinstance(block_size, bool):
            try:
                size = operator.index(block_size)
            except TypeError:
                size = None
        if size is None or size <= 0:
            raise InvalidInputError(
                "block_size",
                f"must be a positive int, got {block_size!r} ({type(block_size).__name__})",
                hint="e.g. block_size=16 (tokens per KV-cache block)",
            )
        if size > _INT32_MAX:  # block number * block_size must fit the int64 slots
            raise InvalidInputError(
                "block_size",
                f"{size} is more than {_INT32_MAX} tokens per block: the slots "
                "(block_number * block_size + offset, int64) would overflow",
                hint="e.g. block_size=16 (tokens per KV-cache block)",
            )
        import torch

        try:
            torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InvalidInputError(
                "device",
                f"{device!r} is not a torch device",
                hint="e.g. device='cpu', 'cuda:0' or torch.device('cpu')",
            ) from None
        self.block_size = size
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, device={self.device!r})"

    def build(
        self,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        block_table: Sequence[Sequence[int]] | torch.Tensor | None,
        *,
        causal: bool = True,
    ) -> AttentionMetadata:
        """Build the metadata of a batch.

        The slot of position ``p`` of sequence ``i`` is
        ``block_table[i, p // block_size] * block_size + p % block_size`` (vLLM's paged
        layout); slots are computed for each sequence's last ``query_lens[i]`` positions.

        Args:
            query_lens: ``[B]`` new tokens per sequence (prefill: the prompt; decode: 1;
                chunked prefill: the chunk).
            seq_lens: ``[B]`` total tokens per sequence, cached prefix included.
            block_table: ``[B, max_blocks]`` cache block numbers, or None when there is no
                cache (``encoder_only``): every slot is then -1.
            causal: False for bidirectional (encoder) attention.

        Returns:
            The metadata, tensors on ``device``. The tensors it makes are ordinary tensors
            even under ``torch.inference_mode()``: they keep version counters, by which the
            backends notice an in-place edit of metadata they have already checked.

        Raises:
            InvalidInputError: lengths or block numbers that are not integers (``[1.5]``),
                or do not fit int32 (named with their position and the value given: the
                metadata holds them in int32), query lengths adding up to more than int32
                holds, lengths of different counts, a negative length, a query longer than its
                sequence, a block table too short for ``seq_lens``, a negative block
                number among those ``seq_lens`` use, or a ``device`` this torch build
                cannot make tensors on (``"cuda"`` in a CPU build).
        """
        import torch

        with torch.inference_mode(False):
            return self._build(query_lens, seq_lens, block_table, causal=causal)

    def _build(
        self,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        block_table: Sequence[Sequence[int]] | torch.Tensor | None,
        *,
        causal: bool,
    ) -> AttentionMetadata:
        import torch

        q_lens = _integers("query_lens", query_lens, "[B] ints, e.g. query_lens=[5, 1]")
        s_lens = _integers("seq_lens", seq_lens, "[B] ints, e.g. seq_lens=[5, 18]")
        q_lens, s_lens = q_lens.reshape(-1), s_lens.reshape(-1)
        num_seqs = int(q_lens.shape[0])
        if int(s_lens.shape[0]) != num_seqs:
            raise InvalidInputError(
                "seq_lens",
                f"has {int(s_lens.shape[0])} entries but query_lens has {num_seqs}",
                hint="give one query length and one sequence length per sequence",
            )
        if bool((q_lens < 0).any()) or bool((s_lens < q_lens).any()):
            raise InvalidInputError(
                "query_lens",
                f"each must be in [0, seq_len]; got query_lens={q_lens.tolist()}, "
                f"seq_lens={s_lens.tolist()}",
                hint="seq_lens count the cached prefix plus the query tokens",
            )
        total = int(q_lens.sum())
        if total > _INT32_MAX:
            raise InvalidInputError(
                "query_lens",
                f"add up to {total} tokens, more than query_start_loc can hold (int32: at "
                f"most {_INT32_MAX})",
                hint="split the batch into batches of fewer than 2**31 tokens",
            )
        if block_table is None:
            table = torch.zeros((num_seqs, 0), dtype=torch.int32)
        else:
            table = _integers(
                "block_table",
                block_table,
                "[B, max_blocks] ints, e.g. block_table=[[0, 1], [2, 0]]",
            ).to(torch.int32)
            if table.dim() == 1 and num_seqs == 0:
                table = table.reshape(0, 0)
            if table.dim() != 2 or int(table.shape[0]) != num_seqs:
                raise InvalidInputError(
                    "block_table",
                    f"shape {tuple(table.shape)} should be [{num_seqs}, max_blocks]",
                    hint="one row of cache block numbers per sequence",
                )
            needed = (s_lens + self.block_size - 1) // self.block_size
            if num_seqs and int(needed.max()) > int(table.shape[1]):
                raise InvalidInputError(
                    "block_table",
                    f"shape {tuple(table.shape)} has too few columns: seq_lens "
                    f"{s_lens.tolist()} need {int(needed.max())} blocks of {self.block_size}",
                    hint="each row needs ceil(seq_len / block_size) block numbers",
                )
            if num_seqs and table.shape[1]:
                used = torch.arange(table.shape[1])[None, :] < needed[:, None]
                if bool((table[used] < 0).any()):
                    raise InvalidInputError(
                        "block_table",
                        f"holds negative block numbers {table[used].tolist()} among the "
                        f"blocks seq_lens {s_lens.tolist()} use",
                        hint="block numbers index the KV cache's axis 1 and are >= 0",
                    )
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        offset_in_query = torch.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
        positions = (s_lens - q_lens)[seq_of_token] + offset_in_query
        if block_table is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        else:
            blocks = table.long()[seq_of_token, positions // self.block_size]
            slot_mapping = blocks * self.block_size + positions % self.block_size
        try:
            on_device = [
                t.to(self.device)
                for t in (
                    query_start_loc.to(torch.int32),
                    s_lens.to(torch.int32),
                    table,
                    slot_mapping,
                )
            ]
        except (RuntimeError, AssertionError, ImportError) as exc:  # e.g. no CUDA in this torch
            raise InvalidInputError(
                "device",
                f"torch cannot make tensors on {self.device!r} here: {exc}",
                hint="use a device this torch build has, e.g. device='cpu'",
            ) from exc
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            query_start_loc=on_device[0],
            max_seq_len=int(s_lens.max()) if num_seqs else 0,
            seq_lens=on_device[1],
            block_table=on_device[2],
            slot_mapping=on_device[3],
            causal=causal,
        )
