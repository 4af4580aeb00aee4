"""PrefixFeatureStore: the rows of indexed prefix blocks kept under their prefix key, handed to a
sequence that shares them (kept first, then borrowed from a block's writer in the same step), and
the borrows resolved to rows of the forward that wrote them."""
import torch

from cluster.models.kv_cache import CachedBlock
from cluster.models.runner import SeqChunk
from cluster.speculative.prefix_features import PrefixFeatureStore

BS = 4


def block(i: int, key: bytes) -> CachedBlock:
    return CachedBlock(block=10 + i, key=key, start=i * BS, end=(i + 1) * BS)


def rows(a: int, b: int) -> torch.Tensor:  # [b - a, 2]: row p is all p
    return torch.arange(a, b).float().view(-1, 1).repeat(1, 2)


def test_kept_blocks_then_borrowed_ones_and_nothing_past_a_gap():
    store = PrefixFeatureStore()
    b0, b1, b2, b3 = block(0, b"k0"), block(1, b"k1"), block(2, b"k2"), block(3, b"k3")
    store.keep(rows(0, 16), 6, [b0, b1])  # b1 not covered (positions 4..7, filled 6): not kept
    assert len(store) == 1
    n, got, filled = store.adopt("s", [b0, b1, b2], None, 2, torch.float32)
    assert n == 1 and filled == BS  # b0 only
    torch.testing.assert_close(got[:BS], rows(0, 4))
    assert not got[BS:].any()
    stale = CachedBlock(10, b"another prefix", 0, BS)  # the block's K/V reused for another prefix
    assert store.adopt("s", [stale], None, 2, torch.float32) == (0, None, 0)
    # b1 and b2 are written this step by "w": borrowed after the kept b0; b3 by "s" itself: not
    n, got, filled = store.adopt("s", [b0, b1, b2, b3], {11: "w", 12: "w", 13: "s"}, 2, torch.bfloat16)
    assert n == 3 and filled == BS and got.shape[0] >= 3 * BS and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[:BS].float(), rows(0, 4))
    # the forward: "x" (positions 0..1), "w" (positions 2..13), "s" (its own chunk from 12)
    chunks = [SeqChunk("x", [1, 2], 0, 1), SeqChunk("w", [3] * 12, 2, 1), SeqChunk("s", [5, 6], 12, 1)]
    assert store.borrowed_rows(chunks) == {"s": [("w", 4, 4, 8, 2 + 2), ("w", 8, 8, 12, 2 + 6)]}  # w's rows of 4..11
    assert store.borrowed_rows(chunks) == {}  # settled once


def test_a_borrow_whose_lender_ran_no_such_rows_is_dropped_and_forget_drops_pending_ones():
    store = PrefixFeatureStore()
    b0, b1 = block(0, b"k0"), block(1, b"k1")
    store.adopt("s", [b0, b1], {10: "w", 11: "w"}, 2, torch.float32)
    # the lender's chunk ends inside block 1: block 1 is dropped (a gap, never drafted from)
    assert store.borrowed_rows([SeqChunk("w", [1] * 6, 0, 1), SeqChunk("s", [2], 8, 1)]) == {"s": [("w", 0, 0, 4, 0)]}
    # a lender that began block 1 in an earlier step (positions 4..5) and ends it in this one
    # (block 0 wholly, block 1's positions 4..5: from its own rows; 6..7 from this forward's)
    assert store.adopt("s", [b0, b1], {10: "w", 11: "w"}, 2, torch.float32)[0] == 2
    assert store.borrowed_rows([SeqChunk("x", [1], 0, 1), SeqChunk("w", [1, 1, 1], 6, 1)]) == {
        "s": [("w", 0, 4, 4, 1), ("w", 4, 6, 8, 1)]}
    store.adopt("t", [b0], {10: "w"}, 2, torch.float32)
    store.forget("t")
    assert store.borrowed_rows([SeqChunk("w", [1] * 6, 0, 1)]) == {}
    store.keep(rows(0, 8), 8, [b0])
    store.clear()
    assert len(store) == 0 and store.adopt("u", [b0], None, 2, torch.float32) == (0, None, 0)
