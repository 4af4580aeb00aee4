"""Block (paged) KV cache bookkeeping: a pool of fixed-size blocks and a block table per sequence.

Owns: which physical blocks a sequence holds, how many tokens of it are cached, growing,
truncating (rollback to a committed length) and freeing, and the slot indices that tell a model
runner where token t of a sequence lives in the flat ``[num_blocks * block_size, ...]`` storage.
Ignores: the tensors themselves (the model runner owns them) and who gets evicted when the pool
is full (the scheduler decides).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCacheFullError(RuntimeError):
    """Not enough free blocks; the scheduler preempts instead of letting this escape."""


@dataclass(slots=True)
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose K/V are valid (the target's committed length in KV)


def sizing_num_blocks(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many blocks fit in a memory budget (bytes_per_token covers all layers, K and V)."""
    return max(2, memory_bytes // (block_size * bytes_per_token))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, BlockTable] = {}

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def num_tokens(self, seq_id: str) -> int:
        table = self._tables.get(seq_id)
        return table.num_tokens if table else 0

    def capacity(self, seq_id: str) -> int:
        table = self._tables.get(seq_id)
        return len(table.blocks) * self.block_size if table else 0

    def blocks_needed(self, seq_id: str, total_tokens: int) -> int:
        """Extra blocks to hold ``total_tokens`` tokens for this sequence."""
        have = len(self._tables[seq_id].blocks) if seq_id in self._tables else 0
        need = -(-total_tokens // self.block_size)
        return max(0, need - have)

    def can_reserve(self, seq_id: str, total_tokens: int) -> bool:
        return self.blocks_needed(seq_id, total_tokens) <= len(self._free)

    # -- mutation ---------------------------------------------------------------------------
    def reserve(self, seq_id: str, total_tokens: int) -> None:
        """Make room for ``total_tokens`` tokens (allocating blocks); does not change num_tokens."""
        extra = self.blocks_needed(seq_id, total_tokens)
        if extra > len(self._free):
            raise KVCacheFullError(f"need {extra} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, BlockTable())
        for _ in range(extra):
            table.blocks.append(self._free.pop())

    def set_num_tokens(self, seq_id: str, num_tokens: int) -> None:
        """Record that K/V for positions [0, num_tokens) are valid (after a forward pass)."""
        table = self._tables[seq_id]
        if num_tokens > len(table.blocks) * self.block_size:
            raise ValueError(f"{seq_id}: {num_tokens} tokens exceed reserved capacity")
        table.num_tokens = num_tokens

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll back to the first ``length`` tokens and free blocks past them."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        if length < 0:
            raise ValueError(f"truncate length must be >= 0, got {length}")
        table.num_tokens = min(table.num_tokens, length)
        keep = -(-length // self.block_size)
        while len(table.blocks) > keep:
            self._free.append(table.blocks.pop())

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(reversed(table.blocks))

    # -- addressing -------------------------------------------------------------------------
    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Flat slot index of every position in [start, end) of this sequence."""
        blocks = self._tables[seq_id].blocks
        bs = self.block_size
        if end > len(blocks) * bs:
            raise ValueError(f"{seq_id}: positions up to {end} but only {len(blocks) * bs} reserved")
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def slot_tensor(self, seq_id: str, end: int) -> torch.Tensor:
        """Slots of positions [0, end) as a tensor. # [end] int64"""
        blocks = torch.tensor(self._tables[seq_id].blocks, dtype=torch.int64)
        bs = self.block_size
        pos = torch.arange(end, dtype=torch.int64)
        return blocks[pos // bs] * bs + pos % bs
