"""Per-batch attention metadata (vLLM's common fields) and the builder that makes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attn_di.exceptions import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionMetadata", "AttentionMetadataBuilder"]


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
    """

    def __init__(self, block_size: int, device: str | torch.device = "cpu") -> None:
        if block_size <= 0:
            raise InvalidInputError("block_size", f"must be positive, got {block_size}")
        self.block_size = block_size
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
            The metadata, tensors on ``device``.

        Raises:
            InvalidInputError: lengths of different counts, a negative length, a query longer
                than its sequence, or a block table too short for ``seq_lens``.
        """
        import torch

        q_lens = torch.as_tensor(query_lens, dtype=torch.int64).reshape(-1)
        s_lens = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(-1)
        num_seqs = int(q_lens.shape[0])
        if int(s_lens.shape[0]) != num_seqs:
            raise InvalidInputError(
                "seq_lens",
                f"has {int(s_lens.shape[0])} entries but query_lens has {num_seqs}",
            )
        if bool((q_lens < 0).any()) or bool((s_lens < q_lens).any()):
            raise InvalidInputError(
                "query_lens",
                f"each must be in [0, seq_len]; got query_lens={q_lens.tolist()}, "
                f"seq_lens={s_lens.tolist()}",
            )
        if block_table is None:
            table = torch.zeros((num_seqs, 0), dtype=torch.int32)
        else:
            table = torch.as_tensor(block_table, dtype=torch.int32)
            if table.dim() == 1 and num_seqs == 0:
                table = table.reshape(0, 0)
            if table.dim() != 2 or int(table.shape[0]) != num_seqs:
                raise InvalidInputError(
                    "block_table",
                    f"shape {tuple(table.shape)} should be [{num_seqs}, max_blocks]",
                )
            needed = (s_lens + self.block_size - 1) // self.block_size
            if num_seqs and int(needed.max()) > int(table.shape[1]):
                raise InvalidInputError(
                    "block_table",
                    f"shape {tuple(table.shape)} has too few columns: seq_lens "
                    f"{s_lens.tolist()} need {int(needed.max())} blocks of {self.block_size}",
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
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            query_start_loc=query_start_loc.to(torch.int32).to(self.device),
            max_seq_len=int(s_lens.max()) if num_seqs else 0,
            seq_lens=s_lens.to(torch.int32).to(self.device),
            block_table=table.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            causal=causal,
        )
