"""Block allocator: growth, rollback, freeing, and a clear error when the pool runs dry."""
import pytest

from compiled_spec.kv_cache import BlockAllocator, KVCacheExhausted, extend_slots


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


def test_extend_slots_is_the_slot_of_each_position():
    """One range per page, across page boundaries and for spans within one page."""
    a = BlockAllocator(num_blocks=24, page_size=4)
    a.grow(1, 3)
    a.grow(2, 40)  # interleaved with request 1's blocks: its table is not one run
    a.grow(1, 40)
    for start in range(0, 33):
        for n in (0, 1, 3, 4, 5, 8):
            out = [-7]
            extend_slots(out, a.tables[1], 4, start, start + n)
            assert out == [-7] + [a.slot(1, p) for p in range(start, start + n)], (start, n)


def test_exhaustion_names_the_numbers():
    a = BlockAllocator(num_blocks=2, page_size=16)
    a.grow(7, 20)
    with pytest.raises(KVCacheExhausted, match=r"request 8 needs 1 more KV blocks .* 0 of 2 are free"):
        a.grow(8, 3)
    assert not a.can_grow(8, 3)
    assert a.tables.get(8, []) == []  # all or nothing


def test_grow_all_is_all_or_nothing():
    """An early step grows its whole batch for the worst case, or nothing (then runs late)."""
    a = BlockAllocator(num_blocks=4, page_size=4)
    a.grow(1, 4)  # 1 block
    assert a.grow_all([(1, 8), (2, 4)])  # +1 and +1
    assert [len(a.tables[1]), len(a.tables[2])] == [2, 1] and a.num_free == 1
    assert not a.grow_all([(1, 12), (2, 8)])  # needs 2, 1 free: nothing grown
    assert [len(a.tables[1]), len(a.tables[2])] == [2, 1] and a.num_free == 1
    assert a.grow_all([(1, 5), (3, 1)])  # covered already, then 1 block for a new request
    assert len(a.tables[1]) == 2 and len(a.tables[3]) == 1 and a.num_free == 0
