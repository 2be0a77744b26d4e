"""Block pool and KV cache manager with exact block ids: allocate, free, prefix hits (including a hit on a
free cached block taken from the middle of the free queue), LRU eviction order, copy-on-write, reference
counts. Pure Python: no jax."""
import pytest

from jaxpaged.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request
from jaxpaged.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, **sp):
    return Request(rid, list(tokens), SamplingParams(**sp), block_size=BS)


def refs(kv, ids):
    return [kv.pool.blocks[i].ref_cnt for i in ids]


def schedule(kv, r, n):
    """What the scheduler does when it first admits a waiting request: prefix hits, slots for the rest, and
    the lookup counted."""
    hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, n - hit.num_tokens, hit.blocks)
    assert new is not None
    r.num_computed_tokens = n
    kv.count_prefix_lookup(r, hit.num_tokens)
    return hit


def test_free_queue_o1_removal_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert q.block_ids() == [1, 3, 4, 2]


def test_pool_allocate_free_and_null_block():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7 and pool.null_block.block_id == 0
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [4, 5, 6, 7]
    pool.free_blocks(reversed(got))
    assert pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert pool.usage == 0.0
    with pytest.raises(ValueError, match="cannot allocate 8 blocks"):
        pool.get_new_blocks(8)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_double_free_is_caught():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free_blocks([b])


def test_block_hash_chains_on_parent():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b1 = hash_block_tokens(a, [5, 6, 7, 8])
    b2 = hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert b1 != b2                                   # same tokens, different prefixes
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a and hash_block_tokens(a, [5, 6, 7, 8]) == b1


def test_request_hashes_full_blocks_only():
    r = req("a", range(10))
    assert len(r.block_hashes) == 2          # 10 tokens: two full blocks of 4
    r.append_output_token(10)
    r.append_output_token(11)
    assert len(r.block_hashes) == 3
    h = None
    for block in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
        h = hash_block_tokens(h, block)
    assert r.block_hashes[2] == h                    # the chain over the three full blocks


def test_allocate_prefix_hit_from_middle_of_free_queue_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", range(10))                   # blocks: [0..3] [4..7] [8, 9]
    schedule(kv, a, 10)
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert refs(kv, [1, 2, 3]) == [1, 1, 1]
    assert set(kv.pool.cached) == set(a.block_hashes)   # the two full blocks
    kv.free(a)
    # tail first: 3 (uncached, forgotten), then 2 and 1, which stay cached
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert kv.pool.blocks[3].block_hash is None and kv.pool.blocks[2].block_hash is not None

    b = req("b", list(range(8)) + [50, 51, 52])   # shares a's two full blocks
    hit = schedule(kv, b, 11)
    assert [x.block_id for x in hit.blocks] == [1, 2] and hit.num_tokens == 8
    # 1 and 2 left the queue from its middle/tail; the new block is the queue's head
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3]
    # in tokens, as vLLM: a queried 10 and hit none; b queried 11 and hit its 8 in a's two blocks
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)

    c = req("c", list(range(4)) + [60, 61, 62, 63, 64])      # shares only the first block, which b holds
    schedule(kv, c, 9)
    assert kv.get_block_ids("c") == [1, 5, 6]
    assert refs(kv, [1, 2, 4, 5, 6]) == [2, 1, 1, 1, 1]
    kv.free(b)
    kv.free(c)
    assert kv.pool.num_free_blocks == 9 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks[1:])
    assert kv.pool.free_queue.block_ids() == [7, 8, 9, 3, 4, 2, 6, 5, 1]


def test_full_prefix_hit_shares_every_block_and_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", range(8))
    schedule(kv, a, 8)
    assert kv.get_block_ids("a") == [1, 2]
    again = req("again", range(8))
    hit = kv.get_computed_blocks(again)
    # both blocks are shared; one token (the 8th) is left to compute for the next token's logits
    assert [b.block_id for b in hit.blocks] == [1, 2] and hit.num_tokens == 7
    assert kv.allocate_slots(again, 1, hit.blocks) == []      # no new block: it lands in shared block 2
    assert kv.get_block_ids("again") == [1, 2] and refs(kv, [1, 2]) == [2, 2]
    assert kv.blocks_to_copy == []                           # a full block is shared, never copied
    again.num_computed_tokens = 8
    again.append_output_token(99)
    assert [b.block_id for b in kv.allocate_slots(again, 1)] == [3]


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=BS)       # blocks 1..5
    a = req("a", range(9))
    schedule(kv, a, 9)
    assert kv.get_block_ids("a") == [1, 2, 3]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    c = req("c", range(100, 113))                          # 13 tokens: 4 blocks
    schedule(kv, c, 13)
    # uncached 4, 5, 3 go first, then the LRU cached block 2 (a's tail) is evicted; 1 survives
    assert kv.get_block_ids("c") == [4, 5, 3, 2]
    assert kv.pool.free_queue.block_ids() == [1]
    hit = kv.get_computed_blocks(req("a2", range(9)))
    assert [b.block_id for b in hit.blocks] == [1]
    assert a.block_hashes[1] not in kv.pool.cached
    # a request that needs more than is free is refused and changes nothing
    d = req("d", range(200, 209))
    assert kv.allocate_slots(d, 9) is None
    assert kv.pool.free_queue.block_ids() == [1] and kv.get_block_ids("d") == []


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = req("a", range(10))
    schedule(kv, a, 10)
    kv.free(a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(req("b", range(10))).blocks == []


def test_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = req("p", range(6))                 # blocks [1 full, 2 holding 2 of 4]
    schedule(kv, parent, 6)
    assert kv.get_block_ids("p") == [1, 2]
    child = req("c", range(6))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [1, 2] and refs(kv, [1, 2]) == [2, 2]
    # both append a different 7th token: the first to write into the shared partly filled block copies it
    child.append_output_token(70)
    assert kv.allocate_slots(child, 1) == []
    assert kv.get_block_ids("c") == [1, 3]
    assert kv.blocks_to_copy == [(2, 3)]
    assert refs(kv, [1, 2, 3]) == [2, 1, 1]
    parent.append_output_token(71)
    assert kv.allocate_slots(parent, 1) == []          # now the sole owner of block 2: no copy
    assert kv.get_block_ids("p") == [1, 2] and kv.blocks_to_copy == [(2, 3)]
    # crossing into a new block allocates without copying
    child.num_computed_tokens = parent.num_computed_tokens = 7
    child.append_output_token(72)
    kv.allocate_slots(child, 1)
    child.num_computed_tokens = 8
    child.append_output_token(73)
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [4]
    assert kv.get_block_ids("c") == [1, 3, 4]
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 7 and all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


def test_copy_on_write_refused_when_pool_is_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS)       # blocks 1, 2
    parent = req("p", range(6))
    schedule(kv, parent, 6)
    child = req("c", range(6))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.append_output_token(9)
    assert kv.allocate_slots(child, 1) is None             # the copy needs a free block
    assert kv.get_block_ids("c") == [1, 2] and kv.blocks_to_copy == []


def test_swap_out_and_in():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=4)
    a = req("a", range(7))
    schedule(kv, a, 7)
    assert kv.get_block_ids("a") == [1, 2]
    assert kv.can_swap_out(a)
    assert kv.swap_out(a) == [(1, 0), (2, 1)]
    assert kv.get_block_ids("a") == [] and kv.pool.num_free_blocks == 5
    b = req("b", range(100, 112))
    schedule(kv, b, 12)
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert kv.swap_in(a) == [(0, 2), (1, 1)]               # free queue order then was [2, 1]
    assert kv.get_block_ids("a") == [2, 1]
    assert sorted(kv.free_cpu_blocks) == [0, 1, 2, 3]


def test_memory_waste_counts_last_block_only():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = req("a", range(5)), req("b", range(8))
    schedule(kv, a, 5)
    schedule(kv, b, 8)
    # a: 2 blocks, 5 used; b: 2 blocks, 8 used -> 3 wasted of 16
    assert kv.memory_waste([a, b]) == 3 / 16
