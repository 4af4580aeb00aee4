"""Block (paged) KV cache bookkeeping: a pool of fixed-size blocks and a block table per sequence.

Owns: which physical blocks a sequence holds, how many tokens of it are cached, growing,
truncating (rollback to a committed length) and freeing, and the slot indices that tell a model
runner where token t of a sequence lives in the flat ``[num_blocks * block_size, ...]`` storage.
With prefix caching on (``enable_prefix_caching``): a reference count per block, so sequences
share the blocks of a common prefix (``match_prefix`` at admission; ``cache_prefix`` indexes a
sequence's full committed blocks), and a block no sequence holds stays indexed and evictable —
counted free, handed out for new tokens least recently released first. Only full blocks of
committed tokens are shared, and a sequence writes only past its own committed length, so a
shared block is never written. A block a scheduled step is about to write (``index_scheduled``)
is indexed at once, so a sequence admitted in the same step shares it — its attention reads the
keys that the same forward writes first, layer by layer — and the step settles it afterwards
(``settle_scheduled``: kept once written, unindexed when the forward failed).
Ignores: the tensors themselves (the model runner owns them), which sequences may share (the
engine decides) and who gets preempted when the pool is full (the scheduler decides).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.models.prefix_cache import PrefixIndex, block_key


class KVCacheFullError(RuntimeError):
    """Not enough free blocks; the scheduler preempts instead of letting this escape."""


@dataclass(slots=True)
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose K/V are valid (the target's committed length in KV)
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the first len(keys) blocks (caching)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A full block of committed K/V indexed by its prefix key: a sequence's positions [start, end)."""
    block: int
    key: bytes
    start: int
    end: int


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
        self._refs = [0] * num_blocks  # sequences holding each block
        self._scheduled: list[tuple[str, CachedBlock]] = []  # indexed before this step writes them
        self.prefix: PrefixIndex | None = None  # None: prefix caching off

    def enable_prefix_caching(self) -> None:
        """Share the blocks of common prefixes from now on (before any sequence holds a block)."""
        if self._tables:
            raise RuntimeError("prefix caching is enabled before the first sequence, not after")
        if self.prefix is None:
            self.prefix = PrefixIndex()

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: unused ones, and cached ones no sequence holds."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix is not None else 0)

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
        return self.blocks_needed(seq_id, total_tokens) <= self.num_free_blocks

    # -- mutation ---------------------------------------------------------------------------
    def reserve(self, seq_id: str, total_tokens: int) -> None:
        """Make room for ``total_tokens`` tokens (allocating blocks); does not change num_tokens."""
        extra = self.blocks_needed(seq_id, total_tokens)
        if extra > self.num_free_blocks:
            raise KVCacheFullError(f"need {extra} blocks, {self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, BlockTable())
        for _ in range(extra):
            block = self._free.pop() if self._free else self.prefix.evict()
            self._refs[block] = 1
            table.blocks.append(block)

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
            self._release(table.blocks.pop())
        del table.keys[length // self.block_size:]  # a block no longer full is no prefix

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is not None:
            for block in reversed(table.blocks):
                self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if self.prefix is not None and self.prefix.key(block) is not None:
            self.prefix.released(block)  # kept, evictable
        else:
            self._free.append(block)

    # -- prefix caching ---------------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """For a sequence holding no blocks: hold the cached blocks of its longest prefix of full
        blocks (leaving at least one token to compute: its logits are needed) and count them
        cached; returns the tokens matched (0 with caching off)."""
        if self.prefix is None or seq_id in self._tables:
            return 0
        bs, table = self.block_size, BlockTable()
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            key = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.prefix.lookup(key)
            if block is None:
                break
            if self._refs[block] == 0:
                self.prefix.held(block)
            self._refs[block] += 1
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        if not table.blocks:
            return 0
        table.num_tokens = len(table.blocks) * bs
        self._tables[seq_id] = table
        return table.num_tokens

    def cache_prefix(self, seq_id: str, token_ids: list[int], committed: int) -> list[CachedBlock]:
        """Index the sequence's full blocks within its first ``committed`` tokens (K/V final:
        ``token_ids[:committed]`` committed) that are not indexed yet; returns those it indexed
        (a prefix another block already holds leaves this one unindexed, and out)."""
        table = self._tables.get(seq_id)
        if self.prefix is None or table is None:
            return []
        return self._index(table, token_ids, min(committed, table.num_tokens) // self.block_size)

    def index_scheduled(self, seq_id: str, token_ids: list[int], end: int) -> None:
        """The step being scheduled computes the K/V of ``token_ids[:end]`` (known tokens, none a
        draft): index its full blocks now, for sequences admitted in the same step; the step
        settles them (``settle_scheduled``) once its forward ran or failed."""
        table = self._tables.get(seq_id)
        if self.prefix is None or table is None:
            return
        full = min(end, len(table.blocks) * self.block_size) // self.block_size
        self._scheduled += [(seq_id, b) for b in self._index(table, token_ids, full)]

    def in_flight(self) -> dict[int, str]:
        """Blocks indexed for the step being scheduled, not written yet: block -> the sequence
        whose forward rows write it."""
        return {b.block: seq_id for seq_id, b in self._scheduled}

    def settle_scheduled(self, written: bool) -> list[tuple[str, CachedBlock]]:
        """The step's forward wrote the blocks indexed by ``index_scheduled`` (returned, with their
        sequences), or failed: they are unindexed (and free once no sequence holds them)."""
        scheduled, self._scheduled = self._scheduled, []
        if written or self.prefix is None:
            return scheduled
        for seq_id, b in scheduled:
            self.prefix.remove(b.block)
            table = self._tables.get(seq_id)
            if table is not None:
                del table.keys[b.start // self.block_size:]
            if self._refs[b.block] == 0:
                self._free.append(b.block)
        return []

    def _index(self, table: BlockTable, token_ids: list[int], full: int) -> list[CachedBlock]:
        """Index the table's first ``full`` blocks past those it indexed; returns the new ones."""
        bs, indexed = self.block_size, []
        while len(table.keys) < full:
            i = len(table.keys)
            key = block_key(table.keys[-1] if table.keys else b"", token_ids[i * bs:(i + 1) * bs])
            if self.prefix.add(key, table.blocks[i]):
                indexed.append(CachedBlock(table.blocks[i], key, i * bs, (i + 1) * bs))
            table.keys.append(key)
        return indexed

    def prefix_blocks(self, seq_id: str) -> list[CachedBlock]:
        """The sequence's leading blocks with a prefix key (after ``match_prefix``: those it shares)."""
        table = self._tables.get(seq_id)
        if table is None:
            return []
        bs = self.block_size
        return [CachedBlock(b, k, i * bs, (i + 1) * bs) for i, (b, k) in enumerate(zip(table.blocks, table.keys))]

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
