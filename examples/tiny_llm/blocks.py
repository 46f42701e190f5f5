"""A KV-cache block allocator: sequences grow block by block and give their blocks back."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The cache has no free block left (raise num_blocks or lower the batch)."""


class BlockAllocator:
    """Hands out cache block numbers from a free list (block 0 is kept free as padding).

    Args:
        num_blocks: blocks in each layer's cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow sequence ``seq_id``'s block list to hold ``num_tokens``; returns the list.

        Raises:
            OutOfBlocksError: not enough free blocks.
        """
        table = self.tables.setdefault(seq_id, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > len(self._free):
            raise OutOfBlocksError(f"sequence {seq_id} needs {needed} blocks, {self.num_free} free")
        for _ in range(max(needed, 0)):
            table.append(self._free.pop())
        return table

    def free(self, seq_id: int) -> None:
        """Give sequence ``seq_id``'s blocks back."""
        self._free.extend(reversed(self.tables.pop(seq_id, [])))
