"""Block KV cache bookkeeping: reserve, truncate (rollback), free, slot addressing."""
import pytest

from cluster.models.kv_cache import KVCacheFullError, KVCacheManager


def test_reserve_slots_truncate_free():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.reserve("a", 6)
    assert kv.num_free_blocks == 2 and kv.capacity("a") == 8
    assert kv.slots("a", 0, 6) == [0, 1, 2, 3, 4, 5]
    kv.reserve("b", 3)
    assert kv.slots("b", 0, 3) == [8, 9, 10]
    kv.set_num_tokens("a", 6)
    kv.truncate("a", 3)  # rollback frees the second block
    assert kv.num_tokens("a") == 3 and kv.num_free_blocks == 2
    kv.reserve("a", 8)
    assert kv.num_free_blocks == 1
    assert kv.slots("a", 4, 6) == [4, 5]  # the block freed by the rollback is reused first
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4


def test_full_pool_raises_and_blocks_needed():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.blocks_needed("x", 9) == 3 and not kv.can_reserve("x", 9)
    with pytest.raises(KVCacheFullError):
        kv.reserve("x", 9)
    kv.reserve("x", 8)
    with pytest.raises(ValueError):
        kv.set_num_tokens("x", 9)
    with pytest.raises(ValueError):
        kv.slots("x", 0, 9)


def _commit(kv: KVCacheManager, seq: str, tokens: list[int]) -> None:
    """A sequence whose K/V for all of ``tokens`` was computed and committed."""
    kv.reserve(seq, len(tokens))
    kv.set_num_tokens(seq, len(tokens))
    kv.cache_prefix(seq, tokens, len(tokens))


def test_prefix_caching_shares_full_committed_blocks_by_reference():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.enable_prefix_caching()
    a = list(range(10))  # two full blocks and half of a third
    _commit(kv, "a", a)
    assert len(kv.prefix) == 2  # the partial block is no prefix
    # b shares a's first 8 tokens; its own ninth token differs after them
    b = a[:8] + [99, 98, 97]
    assert kv.match_prefix("b", b) == 8 and kv.num_tokens("b") == 8
    assert kv._tables["b"].blocks == kv._tables["a"].blocks[:2]  # the same physical blocks
    assert kv.num_free_blocks == 8 - 3  # a's three blocks; b holds no block of its own yet
    kv.reserve("b", len(b))
    assert kv._tables["b"].blocks[2] not in kv._tables["a"].blocks  # it writes only into its own
    # a different first block shares nothing, even with the same second block
    assert kv.match_prefix("c", [7, 1, 2, 3] + a[4:]) == 0 and not kv.has("c")
    # at least one token is left to compute: a prompt of exactly the cached blocks matches one less
    assert kv.match_prefix("d", a[:8]) == 4
    kv.free("d")


def test_released_cached_blocks_are_free_but_kept_until_needed_oldest_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.enable_prefix_caching()
    _commit(kv, "a", [1, 2, 3, 4])
    _commit(kv, "b", [5, 6])
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.prefix.num_evictable == 3  # indexed and free
    assert kv.match_prefix("a2", [1, 2, 3, 4, 0]) == 4  # found again after its sequence left
    kv.free("a2")  # a's blocks released again: now newer than b's
    kv.reserve("n", 4)  # two blocks: the unused one, then the oldest cached one (b's)
    assert kv.match_prefix("b2", [5, 6, 0]) == 0 and kv.match_prefix("a3", [1, 2, 3, 4, 0]) == 4
    kv.free("a3")
    kv.reserve("m", 4)  # the pool is now all cached blocks: a's go, oldest first
    assert kv.match_prefix("a4", [1, 2, 3, 4, 0]) == 0
    with pytest.raises(KVCacheFullError):
        kv.reserve("x", 1)


def test_a_shared_block_outlives_one_holder_and_truncation_unindexes_no_full_block_it_keeps():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.enable_prefix_caching()
    _commit(kv, "a", [1, 2, 3, 4, 5])
    assert kv.match_prefix("b", [1, 2, 3, 4, 5, 6]) == 4
    kv.free("a")
    assert kv.prefix.num_evictable == 0  # b still holds both
    kv.reserve("b", 6)
    kv.set_num_tokens("b", 6)
    kv.truncate("b", 5)  # a rejected draft: the third block is b's own and no longer full
    assert kv._tables["b"].keys == kv._tables["b"].keys[:2] and len(kv._tables["b"].keys) == 2
    kv.cache_prefix("b", [1, 2, 3, 4, 5, 7], 5)
    assert len(kv.prefix) == 2  # nothing past the committed full blocks
    kv.free("b")
    assert kv.num_free_blocks == 6


def test_without_prefix_caching_nothing_is_shared_and_it_cannot_be_turned_on_late():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    _commit(kv, "a", [1, 2, 3, 4])
    assert kv.match_prefix("b", [1, 2, 3, 4, 5]) == 0 and kv.prefix is None
    with pytest.raises(RuntimeError, match="before the first sequence"):
        kv.enable_prefix_caching()


def test_blocks_a_step_will_fill_are_shared_at_once_and_unindexed_when_it_fails():
    """index_scheduled indexes the full blocks a scheduled step computes (before they are
    written), so a sequence admitted in the same step matches them; settling keeps them when the
    forward wrote them and unindexes them when it failed — also once their holders are freed."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.enable_prefix_caching()
    a = list(range(10))
    kv.reserve("a", len(a))
    kv.index_scheduled("a", a, len(a))  # positions 0..9 computed by this step: two full blocks
    assert kv.num_tokens("a") == 0 and len(kv.prefix) == 2
    assert kv.match_prefix("b", a[:8] + [50]) == 8  # admitted in the same step
    written = kv.settle_scheduled(written=True)
    assert [(s, b.start, b.end) for s, b in written] == [("a", 0, 4), ("a", 4, 8)]
    assert kv.settle_scheduled(written=True) == []  # settled once
    kv.free("a")
    kv.free("b")
    c = [9] * 12
    kv.reserve("c", len(c))
    kv.index_scheduled("c", c, 8)  # only what this step computes
    assert kv.match_prefix("d", c + [1]) == 8
    kv.free("c")
    kv.free("d")  # both holders gone before the failure is settled: the blocks sit evictable
    assert kv.settle_scheduled(written=False) == []
    assert kv.match_prefix("e", c + [1]) == 0 and len(kv.prefix) == 2  # a's blocks stay
    assert kv.num_free_blocks == 8 and sorted(kv._free + list(kv.prefix._evictable)) == list(range(8))
    kv.reserve("f", 4)
    kv.index_scheduled("f", [7, 7, 7, 7], 4)
    kv.settle_scheduled(written=False)  # a holder still there: unindexed, and its table forgets the key
    assert kv._tables["f"].keys == [] and len(kv.prefix) == 2
    kv.free("f")
    assert kv.num_free_blocks == 8
