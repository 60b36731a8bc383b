"""What the process holds in memory, read from the allocator and the kernel (Linux, glibc).

Three probes and one action, each with a fallback where the platform lacks it:
- `resident_bytes(ranges)`: how much of some address ranges is in RAM (mincore(2)), so the KV
  pools, left untouched until used, count only the pages a request has written.
- `malloc_stats()`: glibc's own account of its heap (mallinfo2(3)): bytes handed out. torch's
  CPU tensors, oneDNN's scratch buffers, the tokenizer and
  Python's larger objects all come from malloc.
- `file_rss()`: /proc/self/smaps, the resident bytes of each mapped file.
- `release_free_heap()`: hand malloc's freed-but-kept memory back to the kernel
  (malloc_trim(3)). Loading converts every weight through float32 intermediates; glibc keeps
  most of what they took (~650 MiB for the default model) unless asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from functools import cache

PAGE = mmap.PAGESIZE


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def release_free_heap() -> None:
    """Return malloc's free memory to the kernel (glibc); a no-op elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@dataclass(frozen=True)
class MallocStats:
    in_use: int  # bytes handed out and not yet freed (heap chunks and mmapped blocks)


def malloc_stats() -> MallocStats | None:
    """glibc's heap account over all arenas; None where mallinfo2 is missing (glibc < 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return MallocStats(in_use=info.uordblks + info.hblkhd)


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of RAM behind the union of [address, address + size) ranges, counted per page.
    Without mincore (not Linux), every byte of the ranges counts."""
    spans = sorted((addr // PAGE, -(-(addr + size) // PAGE)) for addr, size in ranges if size > 0)
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    libc = _libc()
    total = 0
    for lo, hi in merged:
        n = hi - lo
        if libc is None:
            total += n * PAGE
            continue
        vec = (ctypes.c_ubyte * n)()
        if libc.mincore(ctypes.c_void_p(lo * PAGE), n * PAGE, vec) != 0:
            total += n * PAGE  # not a mapping mincore can read: count it whole
            continue
        total += PAGE * sum(b & 1 for b in bytes(vec))
    return total


def file_rss() -> dict[str, int]:
    """Resident bytes of this process's file mappings (libraries, the model file), by path."""
    files: dict[str, int] = {}
    path = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if len(first) >= 5 and "-" in first[0] and ":" in first[3]:  # a mapping's header line
                path = first[5].strip() if len(first) > 5 and first[5].startswith("/") else None
            elif path is not None and line.startswith("Rss:"):
                files[path] = files.get(path, 0) + int(line.split()[1]) * 1024
    return files


def process_rss() -> int:
    """The resident set size from /proc/self/statm (what `ps` calls RSS)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
