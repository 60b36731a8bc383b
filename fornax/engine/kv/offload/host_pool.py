"""Tier 1's tensors, and the copies between them and the primary pool.

Tier 1 is one uint8 tensor [num_slots, block_bytes]: a slot's row is a whole block, every layer's
K and V for its `block_size` tokens, so a block is one contiguous run of bytes, and its disk file
(disk_store.py) is that run as it is. Inside a row:

    form "auto" (the primary pool's dtype):  values [L, 2, block_size, Hkv, D]
    form "int8":  int8 values [L, 2, block_size, Hkv, D], then float32 scales [L, 2, block_size, Hkv]

("int8" is layers/kv_pool.py's row form: one scale per token and KV head.) The same views are
laid over a staging tensor built from disk payloads, so the disk path reuses the load copies.

Copies go layer by layer, each one `index_select` + `index_copy_` over every block of the step:
a handful of large memory copies rather than one per block.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from dataclasses import dataclass

import torch

from fornax.layers import hugepages
from fornax.layers.kv_pool import LayerKV, dequantize_rows, quantize_rows


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the primary pool's activation dtype
    quantized: bool  # tier form int8 (the primary pool may be either)

    @property
    def value_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def value_bytes(self) -> int:
        n = 1
        for d in self.value_shape:
            n *= d
        return n * (1 if self.quantized else torch.finfo(self.dtype).bits // 8)

    @property
    def scale_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * 4 if self.quantized else 0

    @property
    def block_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes

    def views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, block_bytes] uint8 -> values [n, L, 2, bs, Hkv, D], scales [n, L, 2, bs, Hkv] or None."""
        n = rows.shape[0]
        values = rows[:, : self.value_bytes].view(torch.int8 if self.quantized else self.dtype)
        values = values.view(n, *self.value_shape)
        if not self.quantized:
            return values, None
        scales = rows[:, self.value_bytes :].view(torch.float32).view(n, *self.value_shape[:-1])
        return values, scales


def _primary_blocks(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, ...] -> [num_blocks, block_size, ...] (a view)."""
    return pool.view(pool.shape[0] // block_size, block_size, *pool.shape[1:])


def copy_to_rows(
    layout: BlockLayout,
    layers: list[LayerKV],
    block_ids: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    rows: torch.Tensor,
) -> None:
    """Primary blocks `block_ids` -> tier rows `rows` (of the given views)."""
    bs = layout.block_size
    for li, layer in enumerate(layers):
        for kv, (pool, pool_scale) in enumerate(((layer.k, layer.k_scale), (layer.v, layer.v_scale))):
            src = _primary_blocks(pool, bs).index_select(0, block_ids)  # [n, bs, Hkv, D]
            if scales is None:  # same form both sides
                values[:, li, kv].index_copy_(0, rows, src)
                continue
            if pool_scale is None:  # bf16/fp32 primary -> int8 rows
                q, s = quantize_rows(src)
            else:  # int8 primary: copy values and scales as they are
                q, s = src, _primary_blocks(pool_scale, bs).index_select(0, block_ids)
            values[:, li, kv].index_copy_(0, rows, q)
            scales[:, li, kv].index_copy_(0, rows, s)


def copy_from_rows(
    layout: BlockLayout,
    layers: list[LayerKV],
    rows: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    block_ids: torch.Tensor,
) -> None:
    """Tier rows `rows` -> primary blocks `block_ids`."""
    bs = layout.block_size
    for li, layer in enumerate(layers):
        for kv, (pool, pool_scale) in enumerate(((layer.k, layer.k_scale), (layer.v, layer.v_scale))):
            src = values[:, li, kv].index_select(0, rows)
            target = _primary_blocks(pool, bs)
            if scales is None:
                target.index_copy_(0, block_ids, src)
                continue
            s = scales[:, li, kv].index_select(0, rows)
            if pool_scale is None:
                target.index_copy_(0, block_ids, dequantize_rows(src, s, pool.dtype))
            else:
                target.index_copy_(0, block_ids, src)
                _primary_blocks(pool_scale, bs).index_copy_(0, block_ids, s)


logger = logging.getLogger("fornax.kv.offload")

# Slots made resident ahead of the highest slot handed out so far (see _Prefaulter).
PREFAULT_AHEAD_SLOTS = 128
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing their contents
_PAGE = 4096


class _Prefaulter:
    """Makes tier-1 memory resident just ahead of use, on a thread of its own.

    The pool is untouched memory, so it costs nothing until used; but the first save into a
    fresh slot then page-faults every 4 KiB on the engine thread: saving one request's 36 blocks
    took 14 ms on fresh pages and 4 ms on resident ones (2026-12-05). Slots are handed out in
    ascending order, so this thread keeps the next PREFAULT_AHEAD_SLOTS resident with
    madvise(MADV_POPULATE_WRITE), which never changes a page's contents: racing a save into
    the same memory is harmless. Where the call is missing (not Linux, an older kernel) saves
    simply fault as before.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self._base, self._row = data.data_ptr(), data.shape[1]
        self._num_slots = data.shape[0]
        self._done = 0  # slots below this are resident (or asked to be)
        self._target = 0
        self._wake = threading.Condition()
        self._madvise = None
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
        if self._madvise is not None:
            threading.Thread(target=self._run, name="fornax-kv-prefault", daemon=True).start()

    def advance(self, highest_used_slot: int) -> None:
        target = min(highest_used_slot + 1 + PREFAULT_AHEAD_SLOTS, self._num_slots)
        if target > self._target and self._madvise is not None:
            with self._wake:
                self._target = target
                self._wake.notify()

    def _run(self) -> None:
        # Normal priority, on purpose: a lowered one would let this thread be descheduled while it
        # holds the GIL or the condition's lock, stalling the engine thread behind it.
        while True:
            with self._wake:
                while self._target <= self._done:
                    self._wake.wait()
                start, end = self._done, self._target
            lo = (self._base + start * self._row) // _PAGE * _PAGE
            hi = self._base + end * self._row
            assert self._madvise is not None
            if self._madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
                logger.debug(
                    "MADV_POPULATE_WRITE unavailable (errno %d): saves fault pages in", ctypes.get_errno()
                )
                return
            self._done = end


class HostPool:
    """The tier-1 slots' bytes: untouched (not resident) until used, then kept resident a little
    ahead of use (_Prefaulter)."""

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        self.layout = layout
        # Its own anonymous mapping, resident only as slots are first written (the prefaulter
        # runs ahead of that), and counted apart from malloc's heap in the memory breakdown.
        self.data = hugepages.zeros((num_slots, layout.block_bytes), torch.uint8)
        self.values, self.scales = layout.views(self.data)
        self._prefault = _Prefaulter(self.data)
        self._prefault.advance(-1)  # the first slots before the first save

    def save(self, layers: list[LayerKV], block_ids: list[int], slots: list[int]) -> None:
        copy_to_rows(
            self.layout, layers, torch.tensor(block_ids), self.values, self.scales, torch.tensor(slots)
        )
        self._prefault.advance(max(slots))

    def load(self, layers: list[LayerKV], slots: list[int], block_ids: list[int]) -> None:
        copy_from_rows(
            self.layout, layers, torch.tensor(slots), self.values, self.scales, torch.tensor(block_ids)
        )

    def view(self, slot: int) -> memoryview:
        """A slot's bytes in place (no copy): valid while the slot is not reused."""
        return memoryview(self.data[slot].numpy())

    def load_payloads(self, layers: list[LayerKV], payloads: list[bytes], block_ids: list[int]) -> None:
        """Verified disk payloads -> primary blocks, through a staging tensor with tier 1's views."""
        staging = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(payloads), -1)
        values, scales = self.layout.views(staging)
        copy_from_rows(
            self.layout, layers, torch.arange(len(payloads)), values, scales, torch.tensor(block_ids)
        )
