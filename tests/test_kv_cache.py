"""Block allocator: growth, rollback, freeing, and a clear error when the pool runs dry."""
import pytest

from compiled_spec.kv_cache import BlockAllocator, KVCacheExhausted


def test_grow_shrink_free_and_slots():
    a = BlockAllocator(num_blocks=8, page_size=4)
    a.grow(1, 5)  # 2 blocks
    a.grow(2, 4)  # 1 block
    assert a.num_free == 5
    t1 = a.tables[1]
    assert a.slot(1, 0) == t1[0] * 4 and a.slot(1, 4) == t1[1] * 4
    a.grow(1, 12)  # lookahead up to 3 blocks
    assert len(a.tables[1]) == 3
    a.shrink(1, 6)  # rejected tokens rolled back
    assert len(a.tables[1]) == 2 and a.num_free == 5
    a.free(1)
    a.free(2)
    assert a.num_free == 8 and not a.tables


def test_exhaustion_names_the_numbers():
    a = BlockAllocator(num_blocks=2, page_size=16)
    a.grow(7, 20)
    with pytest.raises(KVCacheExhausted, match=r"request 8 needs 1 more KV blocks .* 0 of 2 are free"):
        a.grow(8, 3)
    assert not a.can_grow(8, 3)
    assert a.tables.get(8, []) == []  # all or nothing
