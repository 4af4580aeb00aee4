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
