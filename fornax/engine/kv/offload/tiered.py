"""TieredConnector: tier 1 (host memory) and tier 2 (disk) behind the KVConnector interface.

What moves when (docs/kv-tiers.md has the whole picture):

* A cached block the primary pool evicts is saved to tier 1 (unless tier 1 holds it already);
  with a disk tier, every block that enters tier 1 is also queued for writing to disk.
* With a disk tier, a finished request's cached blocks are saved the same way right away, so
  they outlive the process even if the primary pool never evicts them.
* A request that misses the primary pool at block i looks for blocks i, i+1, ... in tier 1,
  then on disk, and stops at the first block neither holds. Disk hits are read and verified
  while the step is scheduled (a damaged file is simply a miss); host hits are pinned until the
  plan has copied them.
* A preempted request (swap mode) gets tier-1 slots for its computed blocks, full or not, and
  loads them back when it is readmitted, exactly where recompute would have rewritten them.

Every copy runs in `start_load_kv`, before the step's forward pass, in the order saves ->
disk loads -> host loads: a block saved this step may already belong to another request whose
load or forward writes over it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fornax.engine.kv.block_pool import BlockHash
from fornax.engine.kv.offload.connector import DiskLoad, KVConnector, TransferPlan
from fornax.engine.kv.offload.disk_store import DiskStore
from fornax.engine.kv.offload.host_index import HostIndex
from fornax.engine.kv.offload.host_pool import BlockLayout, HostPool

logger = logging.getLogger("fornax.kv.offload")

if TYPE_CHECKING:
    import torch

    from fornax.engine.request import Request
    from fornax.models.base import KVCache


@dataclass
class OffloadStats:
    """Counters since start (tokens and bytes), occupancy now, and transfer times not yet read."""

    hit_tokens_host: int = 0
    hit_tokens_disk: int = 0
    bytes_to_host: int = 0  # primary -> tier 1 (saves and swap-outs)
    bytes_from_host: int = 0  # tier 1 -> primary (hits and swap-ins)
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    swapped_out: int = 0  # requests
    swapped_in: int = 0
    swap_fallbacks: int = 0  # preemptions that recomputed because tier 1 had no room
    corrupt_chunks: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    disk_bytes_used: int = 0
    disk_bytes_total: int = 0
    # (direction, seconds) for each copy batch: "save" (to host), "load" (to primary), "disk_read"
    transfer_times: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class _Match:
    """A lookup's answer, kept until the allocation after it: host slots and/or disk hashes."""

    start_block: int
    sources: list[tuple[str, BlockHash, int]]  # ("host", hash, slot) | ("disk", hash, -1)


class TieredConnector(KVConnector):
    def __init__(
        self,
        layout: BlockLayout,
        host_blocks: int,
        disk: DiskStore | None,
        enable_prefix_caching: bool,
    ) -> None:
        self.layout, self.block_size = layout, layout.block_size
        self.num_host_slots = host_blocks
        self.index = HostIndex(host_blocks)
        self.pool = HostPool(layout, host_blocks)
        self.disk = disk
        self._prefix = enable_prefix_caching
        self._matches: dict[str, _Match] = {}
        self._plan = TransferPlan()
        self._saving: set[BlockHash] = set()  # hashes with a save in the current plan
        self._swap_ins: list[str] = []  # requests whose swap slots free once the plan ran
        self._writing: dict[BlockHash, int] = {}  # disk writes in flight -> the host slot they read
        self._times: deque[tuple[str, float]] = deque(maxlen=4096)
        self._stats = OffloadStats(
            host_blocks_total=host_blocks, disk_bytes_total=disk.capacity if disk else 0
        )

    # -- scheduler side --
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._matches.pop(request.request_id, None)
        if not self._prefix or request.sampling_params.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
        sources: list[tuple[str, BlockHash, int]] = []
        for i in range(start, max_blocks):
            block_hash = self.block_hash(request, i)
            slot = self.index.lookup(block_hash)
            if slot is not None:
                sources.append(("host", block_hash, slot))
            elif self.disk is not None and block_hash in self.disk:
                sources.append(("disk", block_hash, -1))
            else:
                break
        if not sources:
            return 0
        self._matches[request.request_id] = _Match(start, sources)
        return len(sources) * bs

    def num_swapped_tokens(self, request: Request) -> int:
        entry = self.index.swapped(request.request_id)
        return entry[1] if entry is not None else 0

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int] | None,
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> int:
        rid = request.request_id
        match = self._matches.pop(rid, None)
        if block_ids is None or num_external_tokens == 0:
            return 0
        swapped = self.index.swapped(rid)
        if swapped is not None:  # a swap-in: every computed block comes back from its slot
            slots, num_tokens = swapped
            assert num_external_tokens == num_tokens and num_computed_tokens == 0
            self._plan.loads.extend(zip(slots, block_ids[: len(slots)]))
            self._plan.sources[rid] = (0, ["swap"] * len(slots))
            self._swap_ins.append(rid)
            self._stats.swapped_in += 1
            return num_tokens
        assert match is not None and match.start_block * self.block_size == num_computed_tokens
        loaded = 0
        t0 = time.perf_counter()
        for offset, (tier, block_hash, slot) in enumerate(match.sources):
            block_id = block_ids[match.start_block + offset]
            if tier == "host":
                self.index.pin(slot)
                self._plan.loads.append((slot, block_id))
                self._plan.unpin.append(slot)
                self._stats.hit_tokens_host += self.block_size
            else:
                payload = self.disk.read(block_hash) if self.disk is not None else None
                if payload is None:  # damaged, or evicted since the lookup: recompute from here
                    break
                self._plan.disk_loads.append(DiskLoad(block_id, payload))
                self._stats.hit_tokens_disk += self.block_size
            loaded += 1
        if loaded:
            self._plan.sources[rid] = (match.start_block, [tier for tier, _, _ in match.sources[:loaded]])
        if any(tier == "disk" for tier, _, _ in match.sources[: loaded + 1]):
            self._times.append(("disk_read", time.perf_counter() - t0))
        return loaded * self.block_size

    def on_blocks_evicted(self, evicted: list[tuple[BlockHash, int]]) -> None:
        for block_hash, block_id in evicted:
            self._save(block_hash, block_id)

    def request_finished(self, request: Request, cached_blocks: list[tuple[BlockHash, int]]) -> None:
        self._matches.pop(request.request_id, None)
        self.index.release_swap(request.request_id)  # ended while swapped out
        if self.disk is None:
            return  # tier 1 takes blocks when the primary pool evicts them; nothing to persist
        for block_hash, block_id in cached_blocks:
            if block_hash not in self.disk:
                self._save(block_hash, block_id)

    def _save(self, block_hash: BlockHash, block_id: int) -> None:
        """Copy a primary block to tier 1 in this step's plan (and on to disk)."""
        if block_hash in self._saving:
            return
        if self.index.lookup(block_hash) is not None:
            return  # tier 1 has it (and the disk, or its write is queued)
        slot = self.index.insert(block_hash)
        if slot is None:
            return  # every slot pinned or swapped: the block is dropped, as without tiers
        self._saving.add(block_hash)
        self._plan.saves.append((block_id, slot))
        if self.disk is not None and block_hash not in self.disk and block_hash not in self._writing:
            # The writer thread reads the slot in place: it stays pinned until the write ends.
            self.index.pin(slot)
            self._writing[block_hash] = slot
            self._plan.writes.append((block_hash, slot))

    def swap_out(self, request: Request, block_ids: list[int], num_tokens: int) -> bool:
        slots = self.index.swap_out(request.request_id, len(block_ids), num_tokens)
        if slots is None:
            self._stats.swap_fallbacks += 1
            return False
        self._plan.saves.extend(zip(block_ids, slots))
        self._stats.swapped_out += 1
        return True

    def build_connector_meta(self) -> TransferPlan | None:
        self.get_finished()
        plan, self._plan = self._plan, TransferPlan()
        self._saving.clear()
        plan.release_swaps, self._swap_ins = self._swap_ins, []
        return None if plan.is_empty else plan

    # -- worker side --
    def start_load_kv(self, plan: TransferPlan, kv_cache: KVCache) -> None:
        layers, block_bytes = kv_cache.layers, self.layout.block_bytes
        if plan.saves:
            t0 = time.perf_counter()
            self.pool.save(layers, [b for b, _ in plan.saves], [s for _, s in plan.saves])
            self._times.append(("save", time.perf_counter() - t0))
            self._stats.bytes_to_host += len(plan.saves) * block_bytes
        if plan.writes and self.disk is not None:
            for block_hash, slot in plan.writes:
                if not self.disk.write_async(block_hash, self.pool.view(slot)):
                    self._release_write(block_hash)  # stored meanwhile: nothing to wait for
        if plan.disk_loads or plan.loads:
            t0 = time.perf_counter()
            if plan.disk_loads:
                payloads = [d.payload for d in plan.disk_loads]
                self.pool.load_payloads(layers, payloads, [d.block_id for d in plan.disk_loads])
                self._stats.bytes_from_disk += len(payloads) * block_bytes
            if plan.loads:
                self.pool.load(layers, [s for s, _ in plan.loads], [b for _, b in plan.loads])
                self._stats.bytes_from_host += len(plan.loads) * block_bytes
            self._times.append(("load", time.perf_counter() - t0))
        for slot in plan.unpin:
            self.index.unpin(slot)
        for rid in plan.release_swaps:
            self.index.release_swap(rid)

    def get_finished(self) -> int:
        """Unpin the host slots of disk writes that ended; how many did."""
        if self.disk is None:
            return 0
        done = self.disk.take_finished()
        for block_hash in done:
            self._release_write(block_hash)
        return len(done)

    def _release_write(self, block_hash: BlockHash) -> None:
        slot = self._writing.pop(block_hash, None)
        if slot is not None:
            self.index.unpin(slot)

    # -- life --
    def close(self, kv_cache: KVCache) -> None:
        plan = self.build_connector_meta()
        if plan is not None:
            self.start_load_kv(plan, kv_cache)
        if self.disk is not None:
            if not self.disk.flush():
                logger.warning("KV disk tier: writes still pending at shutdown were lost")
            self.get_finished()

    def check_integrity(self) -> None:
        self.index.check_integrity()

    def memory_tensors(self) -> list[torch.Tensor]:
        return [self.pool.data]

    def stats(self) -> OffloadStats:
        s = self._stats
        s.host_blocks_used = self.index.num_used
        if self.disk is not None:
            s.bytes_to_disk, s.corrupt_chunks = self.disk.bytes_written, self.disk.num_corrupt
            s.disk_bytes_used = self.disk.bytes_used
        times = list(self._times)
        self._times.clear()
        return replace(s, transfer_times=times)
