"""Prefix caching's index: a key names a whole prefix, a prefix has one block, evictable blocks
go oldest first (the reference counting around it: test_kv_cache.py)."""
from cluster.models.prefix_cache import PrefixIndex, block_key


def test_a_key_names_the_whole_prefix():
    first = block_key(b"", [1, 2])
    assert block_key(first, [3, 4]) != block_key(block_key(b"", [9, 2]), [3, 4])  # same block, other prefix
    assert block_key(first, [3, 4]) == block_key(block_key(b"", [1, 2]), [3, 4]) and len(first) == 16
    assert block_key(b"", [1, 2]) != block_key(b"", [2, 1]) != block_key(b"", [1 << 40, 2])


def test_one_block_per_prefix_and_eviction_oldest_released_first():
    idx = PrefixIndex()
    k1, k2 = block_key(b"", [1]), block_key(b"", [2])
    assert idx.add(k1, 5) and not idx.add(k1, 6) and not idx.add(k2, 5)  # a prefix, a block: once each
    assert idx.add(k2, 6) and len(idx) == 2
    idx.released(6)
    idx.released(5)
    idx.held(6)  # matched again: not evictable
    assert idx.num_evictable == 1 and idx.evict() == 5 and idx.key(5) is None
    assert idx.lookup(k1) is None and idx.lookup(k2) == 6 and (idx.hits, idx.queries) == (1, 2)
