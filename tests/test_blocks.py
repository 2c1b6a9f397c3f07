"""The block pool: exact accounting, reference counts, prefix-cache hits and LRU eviction."""
from __future__ import annotations

import pytest

from ttserve.control.blocks import BlockPool
from ttserve.control.request import Request, SamplingParams


def test_allocate_and_free_keep_exact_accounting():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free == 0 and len(set(a + b)) == 8
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    pool.check()
    assert pool.num_free == 3 and pool.num_used == 5


def test_double_free_is_caught():
    pool = BlockPool(4, 4)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)


def test_cached_blocks_survive_free_until_reused_least_recent_first():
    pool = BlockPool(4, 4, enable_caching=True)
    ids = pool.allocate(2)
    pool.cache(ids[0], 0, 111)
    pool.cache(ids[1], 0, 222)
    pool.free(reversed(ids))  # tail first: ids[1] is evicted before ids[0]
    assert pool.lookup([111, 222]).tables[0] == ids
    pool.allocate(2)          # the two never-used blocks go first
    assert pool.lookup([111, 222]).tables[0] == ids
    pool.allocate(1)          # now the least recently freed cached block: the tail
    assert pool.lookup([111, 222]).tables[0] == [ids[0]]
    pool.check()


def test_hit_takes_a_reference_and_leaves_the_free_list():
    pool = BlockPool(4, 4, enable_caching=True)
    ids = pool.allocate(1)
    pool.cache(ids[0], 0, 7)
    pool.free(ids)
    assert pool.num_free == 4 and pool.num_free_among(ids) == 1
    pool.take(ids)
    assert pool.num_free == 3
    pool.take(ids)            # shared by a second request
    pool.free(ids)
    assert pool.num_free == 3
    pool.free(ids)
    assert pool.num_free == 4
    pool.check()


def test_lookup_stops_at_the_first_miss_and_caching_off_never_hits():
    pool = BlockPool(4, 4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, 0, 1)
    pool.cache(b, 0, 3)
    assert pool.lookup([1, 2, 3]).tables[0] == [a]
    off = BlockPool(4, 4)
    off.cache(0, 0, 1)
    assert off.lookup([1]).tables[0] == []


def test_hashes_chain_prefixes_and_salt():
    def req(tokens, salt=""):
        return Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    base = req(list(range(12))).full_block_hashes(4, 12)
    assert len(base) == 3
    # Same second block after a different first block: different hash (the chain).
    other = req([9, 9, 9, 9] + list(range(4, 12))).full_block_hashes(4, 12)
    assert other[1] != base[1] and other[0] != base[0]
    assert req(list(range(12))).full_block_hashes(4, 12) == base
    assert req(list(range(12)), salt="tenant-b").full_block_hashes(4, 12)[0] != base[0]
    assert len(req(list(range(11))).full_block_hashes(4, 11)) == 2  # only full blocks
    grown = req(list(range(8)))
    assert grown.full_block_hashes(4, 4) == base[:1] and grown.full_block_hashes(4, 8) == base[:2]  # extended
