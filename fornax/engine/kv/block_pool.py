"""The physical KV blocks: ref counts, an O(1) LRU free list, and the prefix-cache map.

Pure bookkeeping (docs/architecture.md, rule 1): a block here is an id plus counters; the tensors
that hold K/V live in the runner, indexed by these ids.

Life of a block:

    free (ref_cnt 0, no hash)  --get_new_blocks-->  used (ref_cnt >= 1)
    used  --cache_full_block-->  used + cached (hash -> block in the map)
    used + cached  --free_blocks-->  free + cached: still in the map, so a later request
        with the same prefix can `touch` it back (a prefix hit) until it is evicted
    free + cached  --get_new_blocks-->  evicted (hash dropped) and handed out as new

Invariants (checked by `check_integrity`):
  * a block is in the free queue  <=>  its ref_cnt is 0;
  * `block.block_hash is not None`  <=>  the map sends that hash to this very block;
  * the map is one-to-one: two blocks with equal contents are never both registered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence

# A block's identity for prefix caching: sha256 over (parent hash, the block's tokens).
# Why sha256 rather than Python's hash() of a tuple: hash() is 64 bits, so two different
# prefixes could collide and a request would silently attend over someone else's K/V.
# A 256-bit digest makes that practically impossible, and costs ~0.5 ms for an
# 8k-token prompt (measured), once per prompt, since hash chains are memoized per request.
BlockHash = bytes

# Parent "hash" of a request's first block: 32 zero bytes, the same width as a digest, so
# every hashed message is exactly 32 bytes of parent + 4 bytes per token (injective).
ROOT_BLOCK_HASH: BlockHash = bytes(32)


# Prefix of a salted root's message. Every block hash's message starts with a 32-byte parent
# (ROOT_BLOCK_HASH's zeros or a digest), this one with these bytes instead: for a salted root
# to equal a block hash, a digest would have to begin with them (or sha256 collide), which is
# infeasible; distinct salts give distinct messages, so distinct roots.
_SALT_DOMAIN = b"fornax-cache-salt\0"
# The same for a chain computed under a LoRA adapter: its K/V differ from the base model's and
# from any other adapter's. The adapter's key (a hex digest of its files) has a fixed length,
# so (adapter, salt) pairs give distinct messages, and none equals a salt-only one.
_ADAPTER_DOMAIN = b"fornax-lora-adapter\0"


def salted_root(salt: str | None, adapter_key: str | None = None) -> BlockHash:
    """Parent hash of a request's first block: ROOT_BLOCK_HASH, or a digest of the salt and
    the adapter.

    Two requests share cached blocks only if their whole hash chains match, and a chain starts
    here: different salts (tenants, vLLM's `cache_salt`) never hit each other's blocks, nor do
    different adapters (or an adapter and the base model).
    """
    salt_bytes = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    if adapter_key is not None:
        return hashlib.sha256(_ADAPTER_DOMAIN + adapter_key.encode() + b"\0" + salt_bytes).digest()
    if salt is None:
        return ROOT_BLOCK_HASH
    return hashlib.sha256(_SALT_DOMAIN + salt_bytes).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it identifies the block's tokens AND every token before it."""
    # array('I') packs each id as 4 unsigned bytes in C, far faster than struct per token;
    # token ids are vocabulary indices, so they are non-negative and below 2**32.
    return hashlib.sha256(parent + array("I", token_ids).tobytes()).digest()


class KVBlock:
    """One block of `block_size` token slots. `prev_free`/`next_free` link the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set only while registered in the map
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    The head is evicted first (least recently freed); freed blocks join at the tail.
    Removing a block from the middle is O(1), which a prefix hit on a free cached block
    needs. Two sentinel nodes keep every link operation branch-free.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinel before the first free block
        self._tail = KVBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def _link_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None and block.prev_free is None and block.next_free is None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Add at the tail: evicted last."""
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        """Add at the head: handed out (evicted) first."""
        self._link_after(self._head, block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail, i.e. in eviction order."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All `num_blocks` blocks, the free queue and the `hash -> block` map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Fresh pool: ids come out in ascending order, which keeps tests exact.
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # (hash, block id) of cached blocks handed out again since the last drain, kept only
        # when a KV tier wants them (engine/kv/offload): their contents are intact until the
        # step's forward pass, so there is still time to copy them out.
        self.evicted: list[tuple[BlockHash, int]] | None = None

    # -- counts --
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # -- allocation --
    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the head of the free queue, each with ref_cnt 1.

        A cached block taken here is evicted (its hash dropped): this is the only place
        eviction happens, so the cache keeps everything until the space is really needed.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.evicted is not None:
                    self.evicted.append((block.block_hash, block.block_id))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order.

        At ref_cnt 0 a cached block joins the tail (kept longest), while a block with no
        hash joins the head: it holds nothing anyone can hit, so reusing it first spares the
        cache. Callers pass a request's blocks in reverse so its tail blocks (the least
        likely to be shared) are evicted before its head blocks.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # -- prefix cache --
    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its chained hash; False if not registered.

        If another block already holds this hash (two requests computed the same prefix at
        the same time), the first one stays the canonical copy and this block stays
        unregistered: it is freed like any uncached block, keeping the map one-to-one.
        """
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every hash (e.g. after new weights); blocks in use keep their contents.

        Safe at any time: a running request whose block loses its hash simply will not be
        hit by others. Returns the number of hashes dropped.
        """
        for block in self.cached.values():
            block.block_hash = None
        dropped = len(self.cached)
        self.cached.clear()
        return dropped

    # -- debugging --
    def check_integrity(self) -> None:
        """Assert the invariants in the module docstring; O(num_blocks), for tests."""
        free = list(self.free_queue)
        assert len(free) == len(self.free_queue), "free queue length counter is off"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block appears twice in the free queue"
        zero_ref = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert free_ids == zero_ref, f"free queue {sorted(free_ids)} != ref_cnt 0 blocks {sorted(zero_ref)}"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(free) == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"map entry does not match {block}"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached), "a block has a hash but is not in the map"
        assert self.enable_prefix_caching or not self.cached, "cache entries with prefix caching off"
