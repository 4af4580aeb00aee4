"""Feature rows of shared prefix blocks, for a feature tap that needs the target's features of
every position (the EAGLE head in the engine, KVSync's ``FeatureBuffer`` for a DraftServer's head).
Under prefix caching the target never runs a shared prefix for the sequence that shares it, so
its features there must come from the sequence that ran it.

Owns: ``PrefixFeatureStore`` — per indexed KV block, a copy of its positions' rows under the
block's prefix key (``keep``; at most one entry per block: one indexed again replaces it); for a
sequence admitted onto cached blocks, the leading blocks with kept rows under the same key, then
the blocks the step being scheduled writes for another sequence, borrowed (``adopt``); at the
forward's record, where each borrower's rows are: the lender's own rows before its chunk (a block
it began in an earlier step), that forward's rows after (``borrowed_rows``).
Ignores: what the rows are (fused or raw, their dtype: the tap's), the sequences' own rows and
how far they are filled (the tap's), which blocks may be shared (``cluster.models.kv_cache``).
"""
from __future__ import annotations

import torch

from cluster.models.kv_cache import CachedBlock
from cluster.models.runner import SeqChunk


class PrefixFeatureStore:
    def __init__(self) -> None:
        self._kept: dict[int, tuple[bytes, torch.Tensor]] = {}  # block -> (prefix key, rows [bs, width])
        # sequences admitted this step onto blocks its forward writes for another (the lender):
        # sharer -> [(lender, start, end)], resolved when that forward is recorded
        self._borrow: dict[str, list[tuple[str, int, int]]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, rows: torch.Tensor, filled: int, blocks: list[CachedBlock]) -> None:
        """rows [capacity, width]: a sequence's rows by position, [0, filled) written. Keep the
        rows of each of ``blocks`` (just indexed) that they cover."""
        for b in blocks:
            if filled >= b.end:
                self._kept[b.block] = (b.key, rows[b.start : b.end].clone())

    def adopt(self, seq_id: str, blocks: list[CachedBlock], in_flight: dict[int, str] | None,
              width: int, dtype: torch.dtype) -> tuple[int, torch.Tensor | None, int]:
        """A sequence starts on these cached blocks (positions from 0): (how many leading blocks
        it gets features for, kept then borrowed; its rows [capacity, width] by position, the
        kept ones written, None when none; the positions written from 0). Kept: blocks with rows
        under the same key. Borrowed: blocks ``in_flight`` (block -> the sequence whose forward
        rows write it this step) after the kept ones, resolved by ``borrowed_rows``."""
        kept: list[tuple[CachedBlock, torch.Tensor]] = []
        borrowed: list[tuple[str, int, int]] = []
        for b in blocks:
            entry = self._kept.get(b.block)
            if not borrowed and entry is not None and entry[0] == b.key:
                kept.append((b, entry[1]))
            elif in_flight and in_flight.get(b.block, seq_id) != seq_id:
                borrowed.append((in_flight[b.block], b.start, b.end))
            else:
                break
        self._borrow.pop(seq_id, None)
        if borrowed:
            self._borrow[seq_id] = borrowed
        if not kept and not borrowed:
            return 0, None, 0
        end = borrowed[-1][2] if borrowed else kept[-1][0].end
        rows = torch.zeros(max(64, 2 * end), width, dtype=dtype)
        for b, kept_rows in kept:
            rows[b.start : b.end] = kept_rows
        return len(kept) + len(borrowed), rows, kept[-1][0].end if kept else 0

    def borrowed_rows(self, chunks: list[SeqChunk]) -> dict[str, list[tuple[str, int, int, int, int]]]:
        """A committed forward over ``chunks`` (its rows in chunk order): per borrower in it,
        (lender, start, split, end, row) for each block it borrows from a lender whose chunk ends
        at or past the block's end — positions [start, split) the lender ran in earlier forwards
        (its own rows, before its chunk), [split, end) this forward's rows from ``row`` on. Every
        borrow is settled here: one whose lender ran no such rows is dropped (the borrower keeps a
        gap, and a tap never drafts from a gap)."""
        if not self._borrow:
            return {}
        rows_of, row = {}, 0  # seq -> (first position, first row, end position) of its chunk
        for c in chunks:
            rows_of[c.seq_id] = (c.start_pos, row, c.start_pos + len(c.token_ids))
            row += len(c.token_ids)
        out: dict[str, list[tuple[str, int, int, int, int]]] = {}
        for seq_id, borrows in self._borrow.items():
            for lender, start, end in borrows:
                if lender not in rows_of or rows_of[lender][2] < end:
                    break
                first, r0, _ = rows_of[lender]
                split = min(max(start, first), end)
                out.setdefault(seq_id, []).append((lender, start, split, end, r0 + max(0, split - first)))
        self._borrow.clear()
        return out

    def forget(self, seq_id: str) -> None:
        """The sequence is gone: its pending borrows too."""
        self._borrow.pop(seq_id, None)

    def clear(self) -> None:
        self._kept.clear()
        self._borrow.clear()
