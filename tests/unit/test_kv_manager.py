"""KVCacheManager: block tables, prefix hits on exact blocks, sharing, free order, stats."""

from __future__ import annotations

import pytest

from fornax.engine.kv.manager import KVCacheManager
from fornax.engine.request import Request, SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100))


def compute(kv: KVCacheManager, r: Request, n: int) -> list[int]:
    """Allocate n tokens for r, then mark them computed and cache full blocks (one step)."""
    table = kv.allocate_slots(r, n)
    assert table is not None
    r.num_computed_tokens += n
    kv.cache_blocks(r, r.num_computed_tokens)
    kv.check_integrity()
    return table


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_allocate_grows_the_table_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    r = req("a", list(range(10)))
    assert kv.get_computed_blocks(r) == ([], 0)
    assert compute(kv, r, 10) == [0, 1, 2]
    assert len(kv.pool.cached) == 2  # tokens 0..7: two full computed blocks
    for t in (10, 11):  # decode: block 2 fills up, no new block
        r.append_output_token(t)
        assert compute(kv, r, 1) == [0, 1, 2]
    assert len(kv.pool.cached) == 3
    r.append_output_token(12)
    assert compute(kv, r, 1) == [0, 1, 2, 3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4 and kv.usage == pytest.approx(0.5)
    kv.free(r)
    kv.check_integrity()
    assert kv.usage == 0.0 and kv.get_block_ids("a") == []
    # Freed in reverse: the uncached tail block 3 goes to the head, the cached ones
    # 2, 1, 0 to the tail in that order.
    assert [b.block_id for b in kv.pool.free_queue] == [3, 4, 5, 6, 7, 2, 1, 0]


def test_only_computed_full_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    r = req("a", list(range(12)))
    assert kv.allocate_slots(r, 12) == [0, 1, 2]
    kv.cache_blocks(r, 0)
    assert not kv.pool.cached  # allocated is not computed
    r.num_computed_tokens = 6  # a chunk: block 0 full, block 1 half done
    kv.cache_blocks(r, 6)
    assert [b.block_id for b in kv.pool.cached.values()] == [0]
    r.num_computed_tokens = 12
    kv.cache_blocks(r, 12)
    assert [b.block_id for b in kv.pool.cached.values()] == [0, 1, 2]
    kv.check_integrity()


def test_prefix_hit_reuses_the_exact_blocks_and_shares_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(100, 108))  # two full blocks
    a = req("a", prefix + [1, 2, 3])
    assert compute(kv, a, 11) == [0, 1, 2]
    b = req("b", prefix + [7, 7, 7, 7, 7])
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([0, 1], 8)
    table = kv.allocate_slots(b, 5, hit, n)
    assert table == [0, 1, 3, 4]
    kv.check_integrity()
    assert refs(kv)[:5] == [2, 2, 1, 1, 1]
    assert kv.prefix_cache_queries == 11 + 13 and kv.prefix_cache_hits == 8
    assert kv.prefix_cache_requests == 2
    b.num_computed_tokens = 13
    kv.cache_blocks(b, 13)  # block 3 (7 7 7 7) gets cached; 0 and 1 are not re-registered
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()
    assert refs(kv)[:5] == [1, 1, 0, 1, 1]
    kv.free(b)
    kv.check_integrity()
    assert kv.usage == 0.0


def test_cache_salt_isolates_prefix_hits() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(100, 108)) + [1]  # two full blocks and one token

    def salted(rid: str, salt: str | None) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=100), cache_salt=salt)

    alice = salted("a", "alice")
    assert compute(kv, alice, 9) == [0, 1, 2]
    assert kv.get_computed_blocks(salted("a2", "alice")) == ([0, 1], 8)  # same tenant: hits
    assert kv.get_computed_blocks(salted("b", "bob")) == ([], 0)  # another tenant: none
    assert kv.get_computed_blocks(req("g", prompt)) == ([], 0)  # nor unsalted requests
    bob = salted("b", "bob")
    assert compute(kv, bob, 9) == [3, 4, 5]  # computed again, in blocks of its own
    assert len(kv.pool.cached) == 4  # the same tokens registered twice, once per salt
    unsalted = req("g", prompt)
    assert compute(kv, unsalted, 9) == [6, 7, 8]
    assert kv.get_computed_blocks(req("g2", prompt)) == ([6, 7], 8)
    assert kv.get_computed_blocks(salted("b2", "bob")) == ([3, 4], 8)
    # An empty salt is a salt too: it does not fall back to the shared, unsalted chain.
    assert kv.get_computed_blocks(salted("e", "")) == ([], 0)


def test_a_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(12))
    compute(kv, req("a", tokens), 12)
    # Same 12 tokens: all three blocks are cached, but the last token must be recomputed,
    # so the hit stops at a block boundary below 12 -> 2 blocks, 8 tokens.
    assert kv.get_computed_blocks(req("b", tokens)) == ([0, 1], 8)
    assert kv.get_computed_blocks(req("c", tokens + [5])) == ([0, 1, 2], 12)
    assert kv.get_computed_blocks(req("d", tokens[:3])) == ([], 0)
    assert kv.get_computed_blocks(req("e", [9] + tokens[1:])) == ([], 0)  # chained: 1st block differs


def test_hits_on_free_cached_blocks_revive_them_without_eviction() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = req("a", list(range(8)) + [50])
    compute(kv, a, 9)  # blocks 0 1 cached, 2 partial
    kv.free(a)
    assert [blk.block_id for blk in kv.pool.free_queue] == [2, 3, 1, 0]
    b = req("b", list(range(8)) + [60, 61, 62, 63, 64])
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([0, 1], 8)
    assert kv.allocate_slots(b, 5, hit, n) == [0, 1, 2, 3]
    kv.check_integrity()
    assert kv.num_free_blocks == 0 and len(kv.pool.cached) == 2


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = req("a", list(range(8)) + [1])
    compute(kv, a, 9)
    kv.free(a)  # 0 1 cached and free, 2 3 plain free
    # b hits blocks 0 and 1 (free): touching them leaves 2 free blocks, b needs 3 more.
    b = req("b", list(range(8)) + list(range(20, 29)))
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([0, 1], 8)
    before = ([blk.block_id for blk in kv.pool.free_queue], refs(kv), dict(kv.pool.cached))
    assert kv.allocate_slots(b, 9, hit, n) is None
    assert ([blk.block_id for blk in kv.pool.free_queue], refs(kv), dict(kv.pool.cached)) == before
    assert kv.get_block_ids("b") == [] and kv.prefix_cache_requests == 1
    kv.check_integrity()
    # A growing request that does not fit: None, table unchanged.
    c = req("c", list(range(30, 46)))
    assert compute(kv, c, 16) == [2, 3, 1, 0]  # plain free blocks first, then LRU: 1 before 0
    assert all(blk.ref_cnt == 1 for blk in kv.pool.cached.values()) and len(kv.pool.cached) == 4
    c.append_output_token(1)
    assert kv.allocate_slots(c, 1) is None
    assert kv.get_block_ids("c") == [2, 3, 1, 0]
    kv.check_integrity()


def test_siblings_computing_the_same_prompt_at_once_keep_one_cached_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(9))
    s0, s1 = req("s0", prompt), req("s1", prompt)
    assert kv.get_computed_blocks(s0) == ([], 0) and kv.get_computed_blocks(s1) == ([], 0)
    assert kv.allocate_slots(s0, 9) == [0, 1, 2]
    assert kv.allocate_slots(s1, 9) == [3, 4, 5]
    for s in (s0, s1):
        s.num_computed_tokens = 9
        kv.cache_blocks(s, 9)
    kv.check_integrity()
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]
    # A third sibling arriving later hits the first one's blocks.
    assert kv.get_computed_blocks(req("s2", prompt)) == ([0, 1], 8)
    kv.free(s0)
    kv.free(s1)
    kv.check_integrity()
    assert kv.get_computed_blocks(req("s3", prompt)) == ([0, 1], 8)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    compute(kv, a, 9)
    assert not kv.pool.cached
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0
    kv.free(a)
    kv.check_integrity()


def test_reset_prefix_cache_and_free_of_unknown_request() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(req("ghost", [1]))  # no blocks: a no-op
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()
    assert kv.usage == 0.0


def test_long_prompt_hash_chain_is_incremental() -> None:
    kv = KVCacheManager(num_blocks=600, block_size=16, enable_prefix_caching=True)
    r = req("long", [i % 1000 for i in range(8192)])
    for _ in range(32):  # 256-token chunks
        compute(kv, r, 256)
    assert len(kv.pool.cached) == 512
    assert len(kv._hashes["long"]) == 512  # each block hashed once
    same = req("same", [i % 1000 for i in range(8192)])
    hit, n = kv.get_computed_blocks(same)
    assert n == 8192 - 16 and hit == list(range(511))
