"""Prefix caching's index: which physical KV block holds the K/V of which token prefix.

Owns: the key of a full block (a 128-bit BLAKE2b digest of the previous block's key and this
block's token ids, so a key names the whole prefix up to the block's end and two prefixes that
differ anywhere never share one), the map key -> block of blocks whose K/V is committed and
final, and the least-recently-used order of those no sequence holds any more (evictable: kept
until their block is needed for new tokens). Ignores: reference counts, block tables, allocation
(``cluster.models.kv_cache``), which sequences may share (the engine decides).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block whose tokens follow the prefix keyed ``parent`` (b"" at the start)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class PrefixIndex:
    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}  # key -> the block holding that prefix's last block
        self._key_of: dict[int, bytes] = {}  # its inverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by no sequence, oldest first
        self.hits = 0  # blocks found by lookups (each saved block_size tokens of prefill)
        self.queries = 0  # blocks looked up

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, key: bytes) -> int | None:
        """The block holding this prefix, or None (counted as a query, a hit when found)."""
        self.queries += 1
        block = self._block_of.get(key)
        if block is not None:
            self.hits += 1
        return block

    def key(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def add(self, key: bytes, block: int) -> bool:
        """Index ``block`` under ``key``; False when the prefix is already held by another block
        (this one then stays unindexed and is freed as any other)."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def held(self, block: int) -> None:
        """A sequence holds the block again: not evictable."""
        self._evictable.pop(block, None)

    def released(self, block: int) -> None:
        """No sequence holds the indexed block any more: evictable, newest last."""
        self._evictable[block] = None

    def remove(self, block: int) -> None:
        """Unindex the block (its K/V were never written: the step that was to write them failed)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self._evictable.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently released block and hand it back for new tokens."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
