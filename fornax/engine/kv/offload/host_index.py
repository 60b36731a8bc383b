"""Tier 1's bookkeeping: which host slot holds which block, in LRU order, and who holds a slot.

A slot holds one primary-sized block. It is in exactly one of three states:

    free                                     (on the free list)
    cached: hash -> slot, evictable          (in `_by_hash`, oldest first)
    swapped: owned by a preempted request    (in `_swapped`, never evicted)

A cached slot may also be pinned while a step's plan loads from it, so a save decided in the
same schedule() cannot evict it first. Pure bookkeeping: the tensors live in host_pool.py.
"""

from __future__ import annotations

from collections import OrderedDict

from fornax.engine.kv.block_pool import BlockHash


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> number of plans loading from it
        self._swapped: dict[str, tuple[list[int], int]] = {}  # request id -> (slots, tokens)
        self.num_evicted = 0

    # -- counts --
    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    # -- cached blocks --
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the block, marked most recently used; None on a miss."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def insert(self, block_hash: BlockHash) -> int | None:
        """A slot for a new cached block (evicting the least recently used unpinned one if
        need be), or None when every slot is pinned or swapped."""
        assert block_hash not in self._by_hash, "insert a block only once"
        slots = self._take(1)
        if slots is None:
            return None
        self._by_hash[block_hash] = slots[0]
        return slots[0]

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
        else:
            del self._pins[slot]

    # -- swapped requests --
    def swap_out(self, request_id: str, num_blocks: int, num_tokens: int) -> list[int] | None:
        """Slots for a preempted request's blocks (all or none)."""
        assert request_id not in self._swapped, f"{request_id} is swapped out already"
        slots = self._take(num_blocks)
        if slots is not None:
            self._swapped[request_id] = (slots, num_tokens)
        return slots

    def swapped(self, request_id: str) -> tuple[list[int], int] | None:
        return self._swapped.get(request_id)

    def release_swap(self, request_id: str) -> None:
        """The request's slots go back to the free list (swapped in, or the request ended)."""
        entry = self._swapped.pop(request_id, None)
        if entry is not None:
            self._free.extend(reversed(entry[0]))

    # -- allocation --
    def _take(self, n: int) -> list[int] | None:
        """n slots: free ones first, then evicted cached ones, oldest first; all or none."""
        if n <= len(self._free):
            return [self._free.pop() for _ in range(n)]
        need = n - len(self._free)
        victims: list[BlockHash] = []
        for block_hash, slot in self._by_hash.items():
            if slot not in self._pins:
                victims.append(block_hash)
                if len(victims) == need:
                    break
        if len(victims) < need:
            return None
        out = [self._free.pop() for _ in range(len(self._free))]
        for block_hash in victims:
            out.append(self._by_hash.pop(block_hash))
        self.num_evicted += len(victims)
        return out

    def check_integrity(self) -> None:
        """Every slot in exactly one state; pins only on cached slots. O(num_slots), for tests."""
        cached = list(self._by_hash.values())
        swapped = [s for slots, _ in self._swapped.values() for s in slots]
        every = self._free + cached + swapped
        assert sorted(every) == list(range(self.num_slots)), "a host slot is lost or held twice"
        assert set(self._pins) <= set(cached), "a pinned host slot is not a cached block"
