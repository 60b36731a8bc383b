"""Per-request block tables on top of the BlockPool: prefix lookup, allocate, cache, free.

Pure bookkeeping (docs/architecture.md, rule 1). Token `t` of a request lives in slot
`t % block_size` of block `table[t // block_size]`. A block is "full" once all
`block_size` of its tokens exist; it may be registered in the prefix cache only when all
of them are also computed, because only then does its K/V exist.

`free(request)` is the one place a request's blocks are released (rule 6): the
scheduler calls it on finish, abort and preemption alike.
"""

from __future__ import annotations

from typing import Protocol

from fornax.engine.kv.block_pool import BlockHash, BlockPool, hash_block_tokens, salted_root
from fornax.engine.request import Request


class SlotHolder(Protocol):
    """What allocating, trimming and freeing slots read of a sequence. A `Request` is one; so
    is a draft model's view of a request (engine/spec_decode/draft_model.py), which keeps its
    own blocks in its own manager, without prefix caching (only hashing needs the tokens)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # request_id -> block ids, in token order. Ids (not KVBlock objects) so that handing
        # the table to the runner each step is one list copy.
        self._tables: dict[str, list[int]] = {}
        # request_id -> how many leading blocks of its table are registered in the cache (or
        # came from it); `cache_blocks` resumes from there, so caching is incremental.
        self._num_cached: dict[str, int] = {}
        # request_id -> chained hashes of its full blocks, memoized: all_token_ids only
        # grows, so a full block's hash never changes while the request lives.
        self._hashes: dict[str, list[BlockHash]] = {}
        # Prefix-cache stats in tokens, recorded when a lookup is committed (first
        # allocation of a request's life), so a request that waits several steps for
        # room is counted once, not once per lookup.
        self.prefix_cache_requests = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- counts --
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    # -- hashing --
    def block_hash(self, request: Request, index: int) -> BlockHash:
        """Chained hash of the request's full block `index`, extending the memo as needed."""
        chain = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        assert (index + 1) * bs <= request.num_tokens, "only full blocks have a hash"
        tokens = request.all_token_ids
        while len(chain) <= index:
            i = len(chain)
            parent = (
                chain[-1]
                if chain
                else salted_root(request.cache_salt, request.lora.key if request.lora else None)
            )
            chain.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return chain[index]

    # -- the step protocol --
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's full blocks: (block ids, tokens covered).

        Never covers every token: the last one is always recomputed so the step has logits
        to sample from. Hence at most (num_tokens - 1) // block_size blocks. Changes no
        state except the hash memo; the hits are only claimed by `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # a cached prefix has no logits left to score its prompt tokens with
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i in range(max_blocks):  # hashes are computed lazily: a miss stops the walk
            block = self.pool.get_cached_block(self.block_hash(request, i))
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: SlotHolder,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for num_computed_tokens + num_new_computed_tokens + num_new_tokens tokens.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` (only for a request
        with no blocks yet). Returns the whole block table, or None, having changed nothing,
        if the free blocks do not suffice.
        """
        assert num_new_tokens >= 1, "scheduling zero tokens is a scheduler bug"
        rid = request.request_id
        hits = [self.pool.blocks[i] for i in new_computed_blocks or ()]
        assert len(hits) * self.block_size == num_new_computed_tokens, "hits must be whole blocks"
        table = self._tables.get(rid)
        assert not hits or not table, "prefix hits only extend an empty table"
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_have = len(table or ()) + len(hits)
        num_new_blocks = max(cdiv(num_tokens, self.block_size) - num_have, 0)
        # Touching a free cached hit takes it out of the free queue, so it no longer counts
        # as room for the new blocks: check against what remains, before changing anything.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        if table is None:
            table = self._tables[rid] = []
            self._num_cached[rid] = len(hits)
            if self.enable_prefix_caching:
                self.prefix_cache_requests += 1
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        # Touch hits before taking new blocks, so the eviction in get_new_blocks cannot
        # take one of the very blocks this request is about to reuse.
        self.pool.touch(hits)
        table.extend(b.block_id for b in hits)
        if num_new_blocks:
            table.extend(b.block_id for b in self.pool.get_new_blocks(num_new_blocks))
        return list(table)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that became full and computed, up to `num_computed_tokens`."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached[rid]
        for i in range(start, num_full):
            self.pool.cache_full_block(self.pool.blocks[table[i]], self.block_hash(request, i))
        if num_full > start:
            self._num_cached[rid] = num_full

    def cached_blocks(self, request: Request) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of the request's leading blocks that are in the prefix cache (or whose
        twin is: a duplicate block holds the same K/V as the registered one)."""
        rid = request.request_id
        table = self._tables.get(rid)
        if not table or not self.enable_prefix_caching:
            return []
        n = self._num_cached[rid]
        return [(self.block_hash(request, i), table[i]) for i in range(n)]

    def record_evictions(self) -> None:
        """Keep a list of evicted cached blocks for `take_evicted` (a KV tier is attached)."""
        self.pool.evicted = []

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        evicted = self.pool.evicted
        if not evicted:
            return []
        self.pool.evicted = []
        return evicted

    def trim(self, request: SlotHolder, num_tokens: int) -> int:
        """Release the blocks past the first cdiv(num_tokens, block_size); returns how many.

        Rejected draft tokens leave blocks beyond the request's computed tokens: those go back
        to the pool at once. Only fresh blocks can lie there (cached blocks hold computed
        tokens only), so nothing shared or registered in the prefix cache is touched.
        """
        table = self._tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return 0
        assert self._num_cached[request.request_id] <= keep, "trim would drop a cached block"
        dropped = table[keep:]
        del table[keep:]
        self.pool.free_blocks(self.pool.blocks[i] for i in reversed(dropped))
        return len(dropped)

    def free(self, request: SlotHolder) -> None:
        """Release every block of the request (finish, abort, preempt); a no-op if it has none.

        Blocks go back in reverse, so the request's tail blocks are evicted before its
        head blocks, which are the ones most likely shared with other requests.
        """
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._hashes.pop(rid, None)
        if table:
            self.pool.free_blocks(self.pool.blocks[i] for i in reversed(table))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: every block's ref_cnt equals the number of tables holding it."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
            assert self._num_cached[rid] <= len(table), f"{rid} cached more blocks than it holds"
            for block_id in table:
                refs[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], f"{block} is held by {refs[block.block_id]} tables"
        assert set(self._num_cached) == set(self._tables), "stale per-request cache counters"
