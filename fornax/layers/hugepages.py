"""Tensors in memory the kernel may back with 2 MiB pages (Linux transparent huge pages).

Why: a decode step streams every weight and reads each request's K/V, scattered by block
over a pool of hundreds of MiB. With 4 KiB pages that is a TLB miss every 4 KiB, and the
hardware prefetcher stops at each page edge; perf put about a third of the decode attention
loop's samples on its own software prefetch instructions. On this machine transparent huge
pages are `madvise` only, so nothing got them unless asked. In one process, taking turns
(benchmarks/huge_pages.py, 2026-12-03): the int8 x int8 pass over the default model's
weights ran 1.18x faster at one row, 1.05x at 32, level at 128; decode attention over 30
layers' pools 1.05-1.08x. Whole decode steps moved within this machine's noise.

So the KV pools, and all of a model's weights packed together (most weight tensors are
under 2 MiB alone), are put in anonymous mappings advised MADV_HUGEPAGE before their first
touch. Where the system has no transparent huge pages (or not Linux), they stay plain torch
tensors: this is a speed matter only, and nothing reads the page size.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_usable() -> bool:
    """The kernel has transparent huge pages and lets a mapping ask for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


HUGE_PAGES_USABLE = _thp_usable()


def _huge_page_bytes(nbytes: int, advise: bool = True) -> torch.Tensor:
    """nbytes of uint8, untouched, in an anonymous mapping advised MADV_HUGEPAGE and starting
    on a 2 MiB boundary (one huge page of slack allows for wherever the mapping lands)."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advise:
        buf.madvise(mmap.MADV_HUGEPAGE)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    # frombuffer keeps `buf` alive for as long as the tensor's storage lives.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


ALIGN = 64  # each packed tensor starts on a cache line


def zeros_many(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """torch.zeros for each (shape, dtype), one after another in one fresh anonymous mapping (on
    huge pages where usable). The kernel zero-fills pages at their first write, so the memory
    becomes resident only as it is used (the KV pools: layers/kv_pool.py). One mapping for all,
    not one each: a 2 MiB page at a tensor's end that the tensor only partly fills is resident
    whole once touched, and the default model's 60 pools of 6.4 MiB each wasted 1.6 MiB so."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    starts, total = _layout(sizes)
    if total < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    arena = _huge_page_bytes(total, advise=HUGE_PAGES_USABLE)
    return [arena[a : a + n].view(dtype).view(shape) for (shape, dtype), a, n in zip(specs, starts, sizes)]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """zeros_many for one tensor."""
    return zeros_many([(shape, dtype)])[0]


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each size's start, one after another on cache-line boundaries, and the total."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // ALIGN) * ALIGN
    return starts, total


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, one after another in one huge-page mapping: most of
    a model's weight tensors are under 2 MiB each, so only together do they fill huge pages.
    Where those are not usable, or all of it is under one page, the tensors come back as
    they are."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, total = _layout(sizes)
    if total < HUGE_PAGE or not HUGE_PAGES_USABLE:
        return list(tensors)
    arena = _huge_page_bytes(total)
    out = []
    for t, start, size in zip(tensors, starts, sizes):
        copy = arena[start : start + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out
