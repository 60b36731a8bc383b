"""BlockPool: exact block ids, LRU eviction order, ref counts, integrity after every step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fornax.engine.kv.block_pool import ROOT_BLOCK_HASH, BlockPool, KVBlock, hash_block_tokens


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def h(i: int) -> bytes:
    return hash_block_tokens(ROOT_BLOCK_HASH, [i, i, i, i])


def test_fresh_pool_hands_out_ascending_ids() -> None:
    pool = BlockPool(8, enable_prefix_caching=True)
    pool.check_integrity()
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    a = pool.get_new_blocks(3)
    pool.check_integrity()
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    pool.check_integrity()
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(5 / 8)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    pool.check_integrity()


def test_cached_blocks_are_evicted_lru_only_when_space_is_needed() -> None:
    pool = BlockPool(6, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(4)  # 0 1 2 3
    for i, block in enumerate(blocks):
        assert pool.cache_full_block(block, h(i))
    pool.check_integrity()
    # A request frees its blocks in reverse: its tail blocks are evicted first.
    pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert free_order(pool) == [4, 5, 3, 2, 1, 0]
    assert pool.num_free_blocks == 6 and pool.usage == 0.0
    # Still cached while free.
    assert all(pool.get_cached_block(h(i)) is blocks[i] for i in range(4))
    # Never-cached blocks first: nothing is evicted.
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert len(pool.cached) == 4
    pool.check_integrity()
    # Then LRU: 3 (the request's last block) goes before 2, 1, 0.
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_cached_block(h(3)) is None and blocks[3].block_hash is None
    assert pool.get_cached_block(h(2)) is blocks[2]
    pool.check_integrity()
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert set(pool.cached) == {h(0)}
    pool.check_integrity()


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a = pool.get_new_blocks(4)
    pool.cache_full_block(a[0], h(0))
    pool.cache_full_block(a[1], h(1))
    pool.free_blocks(reversed(a))  # 3, 2 uncached -> head; 1, 0 cached -> tail
    pool.check_integrity()
    assert free_order(pool) == [2, 3, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert len(pool.cached) == 2  # nothing evicted
    pool.check_integrity()


def test_touch_removes_a_free_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(5, enable_prefix_caching=True)
    a = pool.get_new_blocks(3)
    for i, block in enumerate(a):
        pool.cache_full_block(block, h(i))
    pool.free_blocks(reversed(a))
    assert free_order(pool) == [3, 4, 2, 1, 0]
    hit = pool.get_cached_block(h(1))
    assert hit is a[1]
    pool.touch([hit])
    pool.check_integrity()
    assert hit.ref_cnt == 1 and free_order(pool) == [3, 4, 2, 0]
    # A second sharer: ref_cnt 2, and the queue is untouched.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.check_integrity()
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert free_order(pool) == [3, 4, 2, 0, 1]  # back at the tail: most recently used
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([hit])


def test_cache_map_stays_one_to_one() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, h(7))
    assert not pool.cache_full_block(b, h(7))  # same contents computed twice: first copy wins
    assert b.block_hash is None and pool.get_cached_block(h(7)) is a
    assert not pool.cache_full_block(a, h(8))  # already registered
    pool.check_integrity()
    pool.free_blocks([b, a])
    assert free_order(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_prefix_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(3, enable_prefix_caching=False)
    a = pool.get_new_blocks(2)
    assert not pool.cache_full_block(a[0], h(0))
    assert pool.get_cached_block(h(0)) is None
    pool.free_blocks(reversed(a))
    # Uncached blocks go to the head: the same ids come back first.
    assert free_order(pool) == [0, 1, 2]
    pool.check_integrity()


def test_reset_prefix_cache_drops_every_hash() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    a = pool.get_new_blocks(3)
    for i, block in enumerate(a):
        pool.cache_full_block(block, h(i))
    pool.free_blocks([a[2]])
    assert pool.reset_prefix_cache() == 3
    assert not pool.cached and all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()
    pool.free_blocks([a[1], a[0]])
    pool.check_integrity()
    assert pool.usage == 0.0


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # a leaked reference: used but claims to be free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_block_hash_is_chained_and_deterministic() -> None:
    h1 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert len(h1) == 32
    assert h1 != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5])
    # Same tokens after a different prefix: a different block.
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(ROOT_BLOCK_HASH, [5, 6, 7, 8])
    # Large token ids are encoded exactly (no truncation to 16 bits).
    assert hash_block_tokens(ROOT_BLOCK_HASH, [70000]) != hash_block_tokens(ROOT_BLOCK_HASH, [70000 - 65536])


def test_bookkeeping_modules_do_not_import_torch() -> None:
    # fornax/__init__.py re-exports LLM (which needs torch), so the package's own __init__ is
    # bypassed with a bare stand-in: this checks what these modules import, transitively.
    code = (
        "import sys, types, importlib.util\n"
        "spec = importlib.util.find_spec('fornax')\n"
        "pkg = types.ModuleType('fornax')\n"
        "pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['fornax'] = pkg\n"
        "import fornax.engine.kv.block_pool, fornax.engine.kv.manager, fornax.engine.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
