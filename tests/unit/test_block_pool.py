"""Block pool and KV cache manager: accounting, LRU eviction, verified prefix hits."""

from __future__ import annotations

import pytest

from engine.protocol import SamplingParams
from engine.sched.block_pool import BlockPool, hash_block_tokens
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), eos_token_id=None)


def _cache_all(pool: BlockPool, blocks, token_rows) -> list[int]:
    """Cache `blocks` as one chain holding `token_rows`; returns the chain's hashes."""
    parent, hashes = None, []
    for block, row in zip(blocks, token_rows, strict=True):
        h = hash_block_tokens(parent, row)
        assert pool.cache_block(block, h, parent, row)
        hashes.append(h)
        parent = h
    return hashes


def _assert_pool_consistent(pool: BlockPool) -> None:
    free = sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert free == pool.get_num_free_blocks()
    assert all(b.ref_cnt >= 0 for b in pool.blocks)


# ---- BlockPool ---------------------------------------------------------------------------


def test_allocate_and_free_keep_ref_counts_and_free_count():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 5
    assert pool.usage == pytest.approx(3 / 8)
    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert a[0].ref_cnt == 1 and pool.get_num_free_blocks() == 7
    pool.free(a[:1])
    assert pool.get_num_free_blocks() == 8 and pool.usage == 0.0
    _assert_pool_consistent(pool)


def test_double_free_is_an_error_not_a_silent_corruption():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])
    assert pool.get_num_free_blocks() == 2


def test_allocate_beyond_free_raises_and_can_allocate_says_so():
    pool = BlockPool(3)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    with pytest.raises(RuntimeError):
        pool.allocate(4)
    assert pool.get_num_free_blocks() == 3


def test_eviction_takes_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    rows = [[i] * BS for i in range(4)]
    hashes = [hash_block_tokens(None, r) for r in rows]
    for b, h, r in zip(blocks, hashes, rows, strict=True):
        assert pool.cache_block(b, h, None, r)
    # Free in the order 2, 0, 3, 1: that is the eviction order.
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    first = pool.allocate(1)[0]
    assert first is blocks[2]
    assert pool.get_cached_block(hashes[2], None, rows[2]) is None  # evicted
    assert pool.get_cached_block(hashes[0], None, rows[0]) is blocks[0]  # still hittable
    second = pool.allocate(1)[0]
    assert second is blocks[0]
    pool.free([first, second])
    assert pool.get_num_free_blocks() == 4
    _assert_pool_consistent(pool)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    cached, plain1, plain2 = pool.allocate(3)
    row = [7] * BS
    pool.cache_block(cached, hash_block_tokens(None, row), None, row)
    pool.free([cached, plain1, plain2])
    taken = pool.allocate(2)
    assert cached not in taken
    assert pool.get_cached_block(hash_block_tokens(None, row), None, row) is cached
    pool.free(taken)


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(2)
    b, other = pool.allocate(2)
    row = [1, 2, 3, 4]
    h = hash_block_tokens(None, row)
    pool.cache_block(b, h, None, row)
    pool.free([b, other])
    assert pool.get_num_free_blocks() == 2
    hit = pool.get_cached_block(h, None, row)
    pool.touch([hit])
    assert pool.get_num_free_blocks() == 1 and hit.ref_cnt == 1
    # The remaining free block is the other one; the touched block cannot be evicted.
    assert pool.allocate(1) == [other]
    assert pool.get_cached_block(h, None, row) is b
    pool.free([b, other])


def test_lookup_verifies_token_ids_and_parent_not_just_the_hash():
    pool = BlockPool(4)
    b = pool.allocate(1)[0]
    row = [1, 2, 3, 4]
    pool.cache_block(b, 42, None, row)  # a hash chosen to collide with anything we ask
    assert pool.get_cached_block(42, None, row) is b
    assert pool.get_cached_block(42, None, [1, 2, 3, 5]) is None
    assert pool.get_cached_block(42, 99, row) is None
    pool.free([b])


def test_a_taken_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    row = [5] * BS
    h = hash_block_tokens(None, row)
    assert pool.cache_block(a, h, None, row)
    assert not pool.cache_block(b, h, None, row)
    assert b.block_hash is None and pool.get_cached_block(h, None, row) is a
    pool.free([a, b])


def test_reset_prefix_cache_only_when_everything_is_free():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    hashes = _cache_all(pool, blocks, [[1] * BS, [2] * BS])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(hashes[0], None, [1] * BS) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, 1, None, [1] * BS)
    assert pool.get_cached_block(1, None, [1] * BS) is None
    pool.free([b])


# ---- KVCacheManager ----------------------------------------------------------------------


def _compute(mgr: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` with its prefix hit, compute its whole prompt, cache its blocks."""
    hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    mgr.cache_blocks(req, req.num_computed_tokens)
    return new


def test_prefix_hit_across_requests_shares_blocks_with_ref_counts():
    mgr = KVCacheManager(BS, 16)
    a = _req("a", list(range(10)))  # blocks [0-3] [4-7] + partial [8,9]
    _compute(mgr, a)
    b = _req("b", list(range(9)) + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert [h.block_id for h in hits] == mgr.get_block_ids("a")[:2]
    new = mgr.allocate_slots(b, 2, num_hit, hits)
    assert len(new) == 1
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert [h.ref_cnt for h in hits] == [2, 2]
    assert mgr.num_free_blocks == 16 - 4
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free_blocks == 16


def test_prefix_hit_never_covers_the_whole_prompt():
    mgr = KVCacheManager(BS, 16)
    a = _req("a", list(range(8)))  # exactly two full blocks
    _compute(mgr, a)
    mgr.free(a)
    again = _req("again", list(range(8)))
    hits, num_hit = mgr.get_computed_blocks(again)
    assert num_hit == 4 and len(hits) == 1  # last block dropped: its last token must run
    longer = _req("longer", list(range(9)))
    assert mgr.get_computed_blocks(longer)[1] == 8


def test_hit_after_free_revives_cached_blocks_until_they_are_evicted():
    mgr = KVCacheManager(BS, 4)
    a = _req("a", list(range(13)))  # 3 full blocks + partial: every block in the pool
    _compute(mgr, a)
    mgr.free(a)
    assert mgr.num_free_blocks == 4
    b = _req("b", list(range(13)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12
    # The pool is free but for the hits: allocating them must not evict themselves.
    assert mgr.allocate_slots(b, 1, num_hit, hits) is not None
    assert mgr.num_free_blocks == 0
    mgr.free(b)
    # A request with other tokens takes all four blocks: every old entry is evicted.
    c = _req("c", [50 + i for i in range(16)])
    _compute(mgr, c)
    assert mgr.get_computed_blocks(_req("d", list(range(13))))[1] == 0
    mgr.free(c)
    assert mgr.num_free_blocks == 4


def test_allocate_slots_fails_without_side_effects_when_hits_would_be_evicted():
    mgr = KVCacheManager(BS, 3)
    a = _req("a", list(range(9)))  # 2 full blocks cached + 1 partial
    _compute(mgr, a)
    mgr.free(a)
    b = _req("b", list(range(9)) + [7] * 4)  # hit 2 blocks, needs 2 more: only 1 spare
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert mgr.allocate_slots(b, 5, num_hit, hits) is None
    assert mgr.get_block_ids("b") == []
    assert all(h.ref_cnt == 0 for h in hits) and mgr.num_free_blocks == 3
    assert mgr.get_computed_blocks(b)[1] == 8  # nothing was evicted


def test_forced_hash_collision_never_returns_the_wrong_block():
    def collide(parent, tokens):  # every block of every request gets the same hash
        return 7

    mgr = KVCacheManager(BS, 16, hash_fn=collide)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _compute(mgr, a)
    b = _req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert mgr.get_computed_blocks(b) == ([], 0)
    c = _req("c", [1, 2, 3, 4, 9, 9, 9, 9, 9])  # same first block: a true hit, then a miss
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 4 and hits[0].block_id == mgr.get_block_ids("a")[0]
    mgr.free(a)
    assert mgr.num_free_blocks == 16


def test_parent_hash_collision_with_equal_tokens_is_still_a_miss():
    # Chained hashes ignore the parent: [x|y] and [z|y] collide on block 1 by construction.
    mgr = KVCacheManager(BS, 16, hash_fn=lambda parent, tokens: hash(tuple(tokens)))
    a = _req("a", [1] * 4 + [2] * 4 + [3])
    _compute(mgr, a)
    # Block 0 differs, so the walk stops at block 0 and block 1's equal tokens never count.
    assert mgr.get_computed_blocks(_req("b", [9] * 4 + [2] * 4 + [3]))[1] == 0
    mgr.free(a)


def test_cache_blocks_only_covers_computed_full_blocks():
    mgr = KVCacheManager(BS, 16)
    a = _req("a", list(range(12)))
    assert mgr.allocate_slots(a, 6) is not None  # chunk: 6 of 12 tokens this step
    a.num_computed_tokens = 6
    mgr.cache_blocks(a, 6)
    assert mgr.num_cached_blocks("a") == 1
    probe = _req("p", list(range(12)) + [0])
    assert mgr.get_computed_blocks(probe)[1] == 4
    assert mgr.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 12
    mgr.cache_blocks(a, 12)
    assert mgr.num_cached_blocks("a") == 3
    assert mgr.get_computed_blocks(probe)[1] == 12
    mgr.free(a)
    assert mgr.num_free_blocks == 16


def test_blocks_grow_with_output_tokens_and_are_hashed_with_them():
    mgr = KVCacheManager(BS, 16)
    a = _req("a", [1, 2, 3])
    _compute(mgr, a)
    for tok in (4, 5):
        a.append_output_token_ids([tok])
        new = mgr.allocate_slots(a, 1)
        assert new == ([] if tok == 4 else [mgr.get_block_ids("a")[-1]])
        a.num_computed_tokens += 1
        mgr.cache_blocks(a, a.num_computed_tokens)
    assert len(mgr.get_block_ids("a")) == 2 and mgr.num_cached_blocks("a") == 1
    assert mgr.get_computed_blocks(_req("b", [1, 2, 3, 4, 6]))[1] == 4
    mgr.free(a)


def test_free_releases_tail_first_so_tails_are_evicted_first():
    mgr = KVCacheManager(BS, 3)
    a = _req("a", list(range(13)))
    assert mgr.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    mgr.cache_blocks(a, 12)
    ids = mgr.get_block_ids("a")
    mgr.free(a)
    taken = mgr.block_pool.allocate(1)
    assert taken[0].block_id == ids[-1]
    # The first two blocks of the prefix still hit.
    assert mgr.get_computed_blocks(_req("b", list(range(13))))[1] == 8
    mgr.block_pool.free(taken)


def test_reset_prefix_cache_through_the_manager():
    mgr = KVCacheManager(BS, 8)
    a = _req("a", list(range(9)))
    _compute(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(_req("b", list(range(9))))[1] == 0


def test_caching_disabled_in_manager():
    mgr = KVCacheManager(BS, 8, enable_caching=False)
    a = _req("a", list(range(9)))
    _compute(mgr, a)
    assert mgr.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    mgr.free(a)
    assert mgr.num_free_blocks == 8
