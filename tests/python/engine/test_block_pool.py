"""Block pool and KV-cache manager with tiny configs: exact block ids, prefix hits, eviction order."""
import pytest

from tallow.engine.block_pool import BlockPool
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request
from tallow.engine.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_total_tokens=1024)


def schedule_prefill(kv, r):
    hits, n = kv.get_computed_blocks(r)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    return n


def test_allocation_order_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", list(range(100, 105)))
    schedule_prefill(kv, a)
    schedule_prefill(kv, b)
    assert kv.block_ids(a) == [0, 1, 2] and kv.block_ids(b) == [3, 4]
    assert kv.num_free_blocks == 3
    # decode: a's third block has room (10 -> 11 -> 12 tokens), the 13th token needs a new block
    for t in (1, 2):
        a.append_token(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.block_ids(a) == [0, 1, 2]
    a.append_token(3)
    assert kv.allocate_slots(a, 1)
    assert kv.block_ids(a) == [0, 1, 2, 5]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    # without caching, freed blocks are reused FIFO: 6, 7 were never used, then a's tail-first frees
    assert kv.pool.free_block_ids() == [6, 7, 5, 2, 1, 0, 4, 3]


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("r", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids(r) == []


def test_prefix_hits_share_blocks_and_leave_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    system = list(range(1, 9))  # two full blocks
    a = req("a", system + [50, 51, 52])
    assert schedule_prefill(kv, a) == 0
    assert kv.block_ids(a) == [0, 1, 2]
    b = req("b", system + [60])
    assert schedule_prefill(kv, b) == 8  # the shared system prompt is computed once
    assert kv.block_ids(b) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # a prompt that is exactly the cached blocks still computes its last token
    c = req("c", system)
    assert schedule_prefill(kv, c) == 4
    assert kv.block_ids(c) == [0, 4]
    for r in (a, b, c):
        kv.free(r)
    assert kv.num_free_blocks == 10
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_cached_blocks_survive_free_and_evict_lru_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0,1 full (cached), 2 partial
    schedule_prefill(kv, a)
    kv.free(a)
    # uncached block 2 is handed out first, then cached ones from a's tail: 1 before 0
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    b = req("b", [1, 2, 3, 4, 9])
    assert schedule_prefill(kv, b) == 4
    assert kv.block_ids(b) == [0, 1, 3]
    kv.free(b)
    c = req("c", [7, 7, 7, 7, 7, 7, 7])  # needs 4 blocks: evicts both cached blocks
    assert schedule_prefill(kv, c) == 0
    assert sorted(kv.block_ids(c)) == [0, 1, 2, 3]
    assert kv.pool.get_cached_block(b.block_hashes[0]) is None
    kv.free(c)
    assert kv.num_free_blocks == 4


def test_prefix_cache_max_tokens_bounds_retained_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True, prefix_cache_max_tokens=2)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    schedule_prefill(kv, a)
    kv.free(a)
    # only one block (2 tokens) may stay cached once free: the head block 0 (freed last) survives
    cached = [blk.block_id for blk in kv.pool.blocks if blk.block_hash is not None]
    assert cached == [0]
    b = req("b", [1, 2, 3, 4, 5])
    assert schedule_prefill(kv, b) == 2


def test_disabled_cache_still_shares_live_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    schedule_prefill(kv, a)
    b = req("b", [1, 2, 3, 4, 5])
    assert schedule_prefill(kv, b) == 4  # live blocks of a sibling
    kv.free(a)
    kv.free(b)
    c = req("c", [1, 2, 3, 4, 5])
    assert schedule_prefill(kv, c) == 0  # nothing kept once free


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
