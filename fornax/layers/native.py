"""The one native kernel fornax carries: paged attention read in place (kernels/paged_attention.c).

It is plain C with no torch headers, so building it takes about a second with the system C
compiler (a torch C++ extension needs a minute of header parsing on this machine). It is
compiled on first use into the fornax cache, keyed by the source, the flags and the CPU
(`-march=native`), and loaded with ctypes, which releases the GIL for the call. Where no
compiler is found or the build fails, `load_paged_attention()` returns None and attention
falls back to the pure-torch path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from fornax.config import fornax_home

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]

_lock = threading.Lock()
_loaded: dict[str, "PagedAttentionKernel | None"] = {}


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    out_dir = fornax_home() / "kernels"
    target = out_dir / f"paged_attention-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class PagedAttentionKernel:
    """ctypes wrapper; all pointer arguments are checked tensors, so a call cannot read out of bounds
    unless the block tables themselves are wrong (they come from the KV manager)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.paged_attention_f32, torch.bfloat16: lib.paged_attention_bf16}
        p, i, lg, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [p, lg, p, p, p, p, i, p, p, i, i, i, i, i, f, i, i]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self,
        q: torch.Tensor,  # [R, H, D], rows may be strided, heads and dims contiguous
        k_cache: torch.Tensor,  # [num_slots, Hkv, D] contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        row_seq: torch.Tensor,  # [R] int32: index into block_tables
        row_pos: torch.Tensor,  # [R] int32: position of the query; attends to keys 0..pos
        block_size: int,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        rows, heads, dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged attention kernel: unexpected memory layout")
        for t in (block_tables, row_seq, row_pos):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("paged attention kernel: index tensors must be contiguous int32")
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        status = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], row_seq.data_ptr(), row_pos.data_ptr(),
            rows, heads, k_cache.shape[1], dim, block_size, scale, window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"paged attention kernel failed (status {status})")
        return out


def load_paged_attention() -> PagedAttentionKernel | None:
    """The compiled kernel, or None when it cannot be built here (then torch ops are used)."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _try_load()
        return _loaded["kernel"]


def _try_load() -> PagedAttentionKernel | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        return PagedAttentionKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError):
        return None
