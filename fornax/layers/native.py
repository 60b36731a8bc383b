"""fornax's native kernels (kernels/*.c): paged attention read in place, the fused
elementwise ops of a decoder layer (RMSNorm with the residual add, rotary, SiLU * up),
weight-only 4/8-bit matmuls on integer dot products, a bf16 matmul for small steps, and a
whole small step in one call.

They are plain C with no torch headers, so building them takes a second or two with the
system C compiler (a torch C++ extension needs a minute of header parsing on this machine).
They are compiled on first use into one library in the fornax cache, keyed by the sources,
the flags and the CPU (`-march=native`), and called through ctypes, which releases the GIL
for the call. The library links libgomp by soname, so in a process where torch is loaded
first it shares torch's OpenMP runtime and thread pool (two runtimes would spin against
each other on 2 cores). Where the library cannot be built or loaded (no compiler, no writable
cache directory, a failed build), the loaders return None and the layers use torch ops;
nothing else changes, but the process logs why, once, in one line ("fornax.kernels").

A cached library is loaded only when the record written next to it after its build names
the current sources' digest and the library file's own hash (_cached). With FORNAX_DEBUG=1
the wrappers check the indices they pass to C (slots, block tables, row maps) first.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fornax.config import debug_checks_enabled, env_c_compiler, fornax_home
from fornax.layers import isa
from fornax.layers.kv_pool import LayerKV

KERNEL_DIR = Path(__file__).with_name("kernels")
T = TypeVar("T")
# The instruction-set flags come from the level (layers/isa.py): -march=native for the CPU's own.
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]
logger = logging.getLogger("fornax.kernels")

# Range checks of the indices passed to C (check_paged_indices and friends). Off unless
# FORNAX_DEBUG=1: the hot path then pays one global boolean test per call. Tests and
# debugging sessions may switch them with set_debug_checks.
DEBUG_CHECKS: bool = debug_checks_enabled()


def set_debug_checks(enabled: bool) -> None:
    global DEBUG_CHECKS
    DEBUG_CHECKS = enabled


class KernelsUnavailable(Exception):
    """Why the library cannot be built or loaded here; the message ends up in the one warning line."""


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def compile_flags(choice: isa.Choice) -> list[str]:
    """The compiler's flags for a level (isa.current(): FORNAX_ISA against the CPU)."""
    return [BASE_FLAGS[0], *choice.compile_flags, *BASE_FLAGS[1:]]


def _source_digest(flags: list[str]) -> str:
    """What the library depends on: the flags, the CPU (-march/-mtune=native) and every source and header."""
    digest = hashlib.sha256(" ".join(flags).encode() + _cpu_signature().encode())
    for path in sorted(KERNEL_DIR.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _record_path(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _record(source_digest: str, library: Path) -> str:
    """The text of a library's build record: the sources' full digest (the file name keeps only
    16 hex digits of it) and the hash of the library's bytes as built."""
    return f"sources {source_digest}\nlibrary {hashlib.sha256(library.read_bytes()).hexdigest()}\n"


def _cached(library: Path, source_digest: str) -> bool:
    """Whether `library` is what a build of these sources wrote. The record is a file beside the
    library rather than a string compiled into it, because it must be checked before dlopen:
    loading a stale or tampered library already runs its constructors. Hashing the ~150 kB
    file costs well under a millisecond, once per process."""
    try:
        return _record_path(library).read_text() == _record(source_digest, library)
    except OSError:  # no library or no record (an older fornax, a build cut short): rebuild
        return False


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _one_line(text: str, limit: int = 200) -> str:
    """A compiler's or the loader's message, fit for the single warning line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no message")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _find_compiler() -> str:
    requested = env_c_compiler()
    if requested:  # CC given: that compiler or none, as make does
        found = shutil.which(requested)
        if found is None:
            raise KernelsUnavailable(f"CC={requested} is not an executable C compiler")
        return found
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise KernelsUnavailable("no C compiler found: set CC or install gcc")
    return found


def _cache_dir() -> Path:
    try:
        return fornax_home() / "kernels"
    except RuntimeError as exc:  # Path.home(): neither HOME nor a passwd entry
        raise KernelsUnavailable("no home directory for the cache (HOME unset): set FORNAX_HOME") from exc


def _compile(compiler: str, flags: list[str], out: str) -> None:
    sources = sorted(KERNEL_DIR.glob("*.c"))
    cmd = [compiler, *flags, *map(str, sources), "-o", out, "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        raise KernelsUnavailable(f"the build failed: {_one_line(exc.stderr or '')}") from exc
    except subprocess.TimeoutExpired as exc:
        raise KernelsUnavailable("the build took more than 120 s") from exc
    except OSError as exc:  # the compiler vanished or is not executable
        raise KernelsUnavailable(f"cannot run {compiler}: {exc.strerror}") from exc


def _unwritable(out_dir: Path, exc: OSError) -> KernelsUnavailable:
    hint = "set FORNAX_HOME to a writable directory"
    return KernelsUnavailable(f"cannot write to {out_dir} ({exc.strerror or exc}): {hint}")


def library_path(digest: str, choice: isa.Choice) -> Path:
    """Where the library of these sources (digest: _source_digest) for a level lives."""
    return _cache_dir() / f"fornax_kernels-{choice.name}-{digest[:16]}.so"


def _build(choice: isa.Choice) -> Path:
    """The library for the current sources, the level's flags and the CPU: the cached one if its
    record vouches for it (no compiler needed then), else a fresh build. Raises
    KernelsUnavailable saying why there is none."""
    flags = compile_flags(choice)
    try:
        digest = _source_digest(flags)
    except OSError as exc:  # an installation missing or hiding its kernels/ directory
        raise KernelsUnavailable(f"cannot read the kernel sources ({exc})") from exc
    target = library_path(digest, choice)
    out_dir = target.parent
    if _cached(target, digest):
        return target
    compiler = _find_compiler()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Build to a temporary name and rename: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as exc:  # read-only, full, or a file where a directory should be
        raise _unwritable(out_dir, exc) from exc
    try:
        _compile(compiler, flags, tmp)
        record = _record(digest, Path(tmp))
        os.replace(tmp, target)
        # Written last: a library without its record is rebuilt, never trusted. A process racing
        # this one may replace the library before this record lands; the next process then
        # finds them disagreeing and rebuilds, which costs a compile, never a wrong load.
        _write_atomically(_record_path(target), record)
    except OSError as exc:
        raise _unwritable(out_dir, exc) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _check_range(name: str, t: torch.Tensor, bound: int) -> None:
    """IndexError unless every entry of t is in [0, bound): C would read or write out of bounds."""
    if t.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0 or hi >= bound:
        raise IndexError(f"{name} out of range: entries in [{lo}, {hi}], allowed [0, {bound})")


def _check_index_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> None:
    """C reads `numel` entries of `dtype` from t's address: anything else is read as garbage."""
    if t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise IndexError(f"{name} has {t.numel()} entries for {numel} rows")


def check_paged_indices(
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    rows: int,
    num_slots: int,
    block_size: int,
) -> None:
    """The indices paged attention follows: row r reads block_tables[row_seq[r]][0 .. row_pos[r] //
    block_size], and block b holds slots b * block_size .. + block_size - 1 of pools of num_slots
    rows. Every entry of the tables is checked, the padding too (build_attention_metadata pads
    with block 0), so a bad id is caught whichever row would read it."""
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    _check_index_tensor("block_tables", block_tables, torch.int32)
    _check_index_tensor("row_seq", row_seq, torch.int32, rows)
    _check_index_tensor("row_pos", row_pos, torch.int32, rows)
    _check_range("row_seq", row_seq, block_tables.shape[0])
    _check_range("row_pos", row_pos, block_tables.shape[1] * block_size)
    _check_range("block_tables", block_tables, num_slots // block_size)


def check_slots(slots: torch.Tensor, rows: int, num_slots: int) -> None:
    """The cache slots new K/V rows are written to: rows of them, each in [0, num_slots)."""
    _check_index_tensor("slots", slots, torch.int64, rows)
    _check_range("slots", slots, num_slots)


class PagedAttentionKernel:
    """ctypes wrapper; all pointer arguments are checked tensors, so a call cannot read out of bounds
    unless the indices themselves are wrong (they come from the KV manager; FORNAX_DEBUG=1
    checks their range before each call)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        # (query dtype, int8 pools?) -> entry point
        self._fns = {
            (torch.float32, False): lib.paged_attention_f32,
            (torch.bfloat16, False): lib.paged_attention_bf16,
            (torch.float32, True): lib.paged_attention_f32_i8,
            (torch.bfloat16, True): lib.paged_attention_bf16_i8,
        }
        p, i, lg, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [p, lg, p, p, p, p, p, p, i, p, p, i, i, i, i, i, f, i, i, i]
        self._store_i8 = {torch.float32: lib.kv_store_i8_f32, torch.bfloat16: lib.kv_store_i8_bf16}
        for fn in self._store_i8.values():
            fn.restype, fn.argtypes = None, [p, lg, i, p, i, i, p, p]

    def supports(self, dtype: torch.dtype) -> bool:
        return (dtype, False) in self._fns

    def __call__(
        self,
        q: torch.Tensor,  # [R, H, D], rows may be strided, heads and dims contiguous
        cache: LayerKV,  # pools [num_slots, Hkv, D] contiguous (int8 ones with their scales)
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        row_seq: torch.Tensor,  # [R] int32: index into block_tables
        row_pos: torch.Tensor,  # [R] int32: position of the query; attends to keys 0..pos
        block_size: int,
        scale: float,
        window: int | None,
        part_keys: int = 0,
    ) -> torch.Tensor:
        """part_keys > 0: every row attends in parts of that many keys, whatever the call's
        rows and threads (deterministic mode); 0: split as suits the call."""
        rows, heads, dim = q.shape
        pools = cache.tensors()
        if q.stride(2) != 1 or q.stride(1) != dim or not all(t.is_contiguous() for t in pools):
            raise ValueError("paged attention kernel: unexpected memory layout")
        if cache.k.dtype != (torch.int8 if cache.quantized else q.dtype):
            raise ValueError(f"paged attention kernel: {cache.k.dtype} pools for {q.dtype} queries")
        for t in (block_tables, row_seq, row_pos):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("paged attention kernel: index tensors must be contiguous int32")
        if DEBUG_CHECKS:
            check_paged_indices(block_tables, row_seq, row_pos, rows, cache.k.shape[0], block_size)
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        status = self._fns[(q.dtype, cache.quantized)](
            q.data_ptr(),
            q.stride(0),
            cache.k.data_ptr(),
            cache.v.data_ptr(),
            data_ptr_or_none(cache.k_scale),
            data_ptr_or_none(cache.v_scale),
            out.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            row_seq.data_ptr(),
            row_pos.data_ptr(),
            rows,
            heads,
            cache.k.shape[1],
            dim,
            block_size,
            scale,
            window or 0,
            torch.get_num_threads(),
            part_keys,
        )
        if status:
            raise RuntimeError(f"paged attention kernel failed (status {status})")
        return out

    def write_int8(self, cache: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Quantize new rows k, v ([T, Hkv, D], rows may be strided) into int8 pools at slots
        (int64), as LayerKV.write does in torch, to the bit; returns False for what it does not
        take (the caller then writes with torch). In torch that is ~10 ops per pool per layer."""
        if k.dtype not in self._store_i8 or slots.dtype != torch.int64 or not slots.is_contiguous():
            return False
        if any(x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.dtype != k.dtype for x in (k, v)):
            return False
        if DEBUG_CHECKS:
            check_slots(slots, k.shape[0], cache.k.shape[0])
            if v.shape[0] != k.shape[0]:
                raise IndexError(f"int8 K/V write: {k.shape[0]} K rows but {v.shape[0]} V rows")
        for x, pool, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            self._store_i8[k.dtype](
                x.data_ptr(),
                x.stride(0),
                x.shape[0],
                slots.data_ptr(),
                x.shape[1],
                x.shape[2],
                pool.data_ptr(),
                data_ptr_or_none(scales),
            )
        return True


def data_ptr_or_none(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes, None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def _row_view_ok(t: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride): a view into a fused projection's output is fine."""
    return t.dim() == 2 and t.stride(1) == 1


class FusedOps:
    """ctypes wrappers of kernels/fused_ops.c. Each mirrors one torch expression (see there);
    callers check `supports(dtype)` and keep the torch form as the fallback."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, lg, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        self._norm = {torch.float32: lib.rms_norm_f32, torch.bfloat16: lib.rms_norm_bf16}
        self._norm_f32w = {torch.float32: lib.rms_norm_f32w_f32, torch.bfloat16: lib.rms_norm_f32w_bf16}
        for fn in self._norm_f32w.values():
            fn.restype, fn.argtypes = None, [p, lg, p, p, i, i, f, i]
        self._rotary = {torch.float32: lib.rotary_f32, torch.bfloat16: lib.rotary_bf16}
        self._silu_mul = {torch.float32: lib.silu_mul_f32, torch.bfloat16: lib.silu_mul_bf16}
        for fn in self._norm.values():
            fn.restype, fn.argtypes = None, [p, lg, p, lg, p, p, p, i, i, f, i]
        for fn in self._rotary.values():
            fn.restype, fn.argtypes = None, [p, lg, i, i, i, p, p, i]
        for fn in self._silu_mul.values():
            fn.restype, fn.argtypes = None, [p, lg, p, i, i, i]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._norm

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(s), s) with s = x + residual when a residual is given, else (norm(x), None).
        x, residual: [rows, dim]."""
        rows, dim = x.shape
        if not _row_view_ok(x) or (
            residual is not None and (residual.shape != x.shape or not _row_view_ok(residual))
        ):
            raise ValueError("rms_norm kernel: inputs must be [rows, dim] with contiguous rows")
        if not weight.is_contiguous() or weight.dtype != x.dtype or weight.numel() != dim:
            raise ValueError("rms_norm kernel: weight must be a contiguous [dim] of the input's dtype")
        out = torch.empty((rows, dim), dtype=x.dtype)
        summed = None if residual is None else torch.empty((rows, dim), dtype=x.dtype)
        self._norm[x.dtype](
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            None if summed is None else summed.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out, summed

    def rms_norm_f32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """cast(x * rsqrt(mean(x^2) + eps) * weight) for a float32 weight, x [rows, dim]."""
        rows, dim = x.shape
        if not _row_view_ok(x):
            raise ValueError("rms_norm kernel: inputs must be [rows, dim] with contiguous rows")
        if not weight.is_contiguous() or weight.dtype != torch.float32 or weight.numel() != dim:
            raise ValueError("rms_norm kernel: weight must be a contiguous float32 [dim]")
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._norm_f32w[x.dtype](
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary_(self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first num_heads heads of each row of x [rows, >= num_heads * head_dim];
        cos, sin: [rows, head_dim] contiguous, x's dtype."""
        rows, head_dim = cos.shape
        if not _row_view_ok(x) or x.shape[0] != rows or x.shape[1] < num_heads * head_dim:
            raise ValueError("rotary kernel: x must be [rows, >= num_heads * head_dim] with contiguous rows")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype):
            raise ValueError("rotary kernel: cos and sin must be contiguous, in x's dtype")
        self._rotary[x.dtype](
            x.data_ptr(),
            x.stride(0),
            rows,
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up], [rows, 2 * inter] -> [rows, inter]."""
        rows, width = gate_up.shape
        if not _row_view_ok(gate_up) or width % 2:
            raise ValueError("silu_mul kernel: gate_up must be [rows, 2 * inter] with contiguous rows")
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out


class QuantMatmul:
    """ctypes wrappers of kernels/quant_matmul.c: y = x W^T for W in 4- or 8-bit blocks of 32
    (formats there; built by layers/linear.py). Loaded at every native level (docs/kernels.md)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self._fns = {
            ("q4", torch.float32): lib.q4_matmul_f32,
            ("q4", torch.bfloat16): lib.q4_matmul_bf16,
            ("q8", torch.float32): lib.q8_matmul_f32,
            ("q8", torch.bfloat16): lib.q8_matmul_bf16,
        }
        for fn in self._fns.values():
            fn.restype, fn.argtypes = ctypes.c_int, [p, lg, i, i, p, p, p, i, p, i]

    MAX_ROWS = 64  # the kernel's limit on activation rows per call (quant_matmul.c MAX_ROWS)

    def __call__(
        self,
        fmt: str,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor | None,
        n: int,
    ) -> torch.Tensor:
        """y [T, n] = x W^T, x: [T, K] (any row stride). W in the kernel's tiles (layers/linear.py
        BlockInt4 / BlockInt8): fmt "q4": 4-bit pairs, float16 scales and offsets; "q8": int8
        values, float16 scales, offset None."""
        if x.dtype not in (torch.float32, torch.bfloat16):  # float16 models: through float32
            return self(fmt, x.float(), qweight, scale, offset, n).to(x.dtype)
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        if qweight.numel() * (2 if fmt == "q4" else 1) < n * k:
            raise ValueError("quantized matmul: weight smaller than [n, k]")
        out = torch.empty((rows, n), dtype=x.dtype)
        fn, threads = self._fns[(fmt, x.dtype)], torch.get_num_threads()
        for r0 in range(0, rows, self.MAX_ROWS):  # the kernel takes at most MAX_ROWS rows a call
            r1 = min(rows, r0 + self.MAX_ROWS)
            status = fn(
                x[r0].data_ptr(),
                x.stride(0),
                r1 - r0,
                k,
                qweight.data_ptr(),
                scale.data_ptr(),
                None if offset is None else offset.data_ptr(),
                n,
                out[r0].data_ptr(),
                threads,
            )
            if status:
                raise RuntimeError(f"quantized matmul kernel failed (status {status})")
        return out


class _DenseMatmul:
    """ctypes wrapper of a dense kernel y = x W^T over a Linear's own weight [N, K]: the entry
    point `symbol` for activations and weights of `dtype` (subclasses name both)."""

    symbol: str
    dtype: torch.dtype

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        self._fn = getattr(lib, self.symbol)
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, i, p, i]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y [T, N] = x W^T; x: [T, K] (any row stride), weight: [N, K] contiguous, both `dtype`."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n, k = weight.shape
        if (
            x.dtype != self.dtype
            or weight.dtype != self.dtype
            or x.shape[1] != k
            or not weight.is_contiguous()
        ):
            raise ValueError(f"{self.symbol}: x [T, K] and a contiguous weight [N, K], both {self.dtype}")
        out = torch.empty((x.shape[0], n), dtype=self.dtype)
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            k,
            weight.data_ptr(),
            n,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"{self.symbol} kernel failed (status {status})")
        return out


class Bf16Matmul(_DenseMatmul):
    """kernels/bf16_matmul.c: y = x W^T for a bf16 Linear's own weight, for steps of a few rows.
    Loaded at every native level (docs/kernels.md)."""

    symbol, dtype = "bf16_matmul_bf16", torch.bfloat16


class F32Matmul(_DenseMatmul):
    """kernels/f32_matmul.c: y = x W^T in float32 with a fixed order of additions per output
    (deterministic mode's float32 layers)."""

    symbol, dtype = "f32_matmul_f32", torch.float32


class LoRAKernel:
    """ctypes wrapper of kernels/lora.c: each adapted row's low-rank products, added into y in place
    (layers/lora.py LoRASlots)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self._fns = {torch.float32: lib.lora_add_f32, torch.bfloat16: lib.lora_add_bf16}
        for fn in self._fns.values():
            fn.restype, fn.argtypes = ctypes.c_int, [p, lg, p, lg, i, i, p, p, p, i, p, i, i, i]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self,
        x: torch.Tensor,  # [T, in], rows may be strided
        y: torch.Tensor,  # [T, out], the base projection, updated in place
        a: torch.Tensor,  # [slots, parts, max_rank, in] float32
        b: torch.Tensor,  # [slots, max_rank, out] float32
        row_slot: torch.Tensor,  # [T] int32, < 0: the row is left as it is
        bounds: torch.Tensor,  # [parts + 1] int32: each part's first output column, then out
        rank: int,
    ) -> None:
        rows, parts = x.shape[0], bounds.shape[0] - 1
        if (
            x.dtype != y.dtype
            or x.dtype not in self._fns
            or x.stride(1) != 1
            or y.stride(1) != 1
            or not (a.is_contiguous() and b.is_contiguous() and row_slot.is_contiguous())
            or a.dtype != torch.float32
            or b.dtype != torch.float32
            or row_slot.dtype != torch.int32
            or row_slot.numel() != rows
            or y.shape[0] != rows
            or a.shape[1] != parts
            or a.shape[3] != x.shape[1]
            or b.shape[2] != y.shape[1]
            or int(bounds[-1]) != y.shape[1]
        ):
            raise ValueError("LoRA kernel: unexpected shapes, dtypes or layouts")
        if DEBUG_CHECKS:
            _check_range("row_slot", row_slot.clamp(min=-1) + 1, a.shape[0] + 1)
        status = self._fns[x.dtype](
            x.data_ptr(),
            x.stride(0),
            y.data_ptr(),
            y.stride(0),
            rows,
            x.shape[1],
            a.data_ptr(),
            b.data_ptr(),
            row_slot.data_ptr(),
            parts,
            bounds.data_ptr(),
            a.shape[2],
            rank,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"LoRA kernel failed (status {status})")


class AmxBf16Matmul:
    """ctypes wrapper of kernels/amx_matmul.c: y = x W^T on AMX tiles, W packed as
    layers/linear.py AmxBf16 packs it. Only loaded where the CPU has AMX-BF16 and the OS lets
    this process use it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        self._fn = lib.amx_bf16_matmul
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, i, p, i]

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """y [T, N] = x W^T; x: [T, K] bf16 (any row stride); packed: [N_pad / 16, K / 32, 16, 16, 2]."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        blocks, ksteps = packed.shape[:2]
        if (
            x.dtype != torch.bfloat16
            or packed.dtype != torch.bfloat16
            or not packed.is_contiguous()
            or x.shape[1] != ksteps * 32
            or blocks * 16 < out_features
        ):
            raise ValueError("AMX matmul: x [T, K] bfloat16 and weights packed for K and N")
        out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            packed.data_ptr(),
            out_features,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"AMX matmul kernel failed (status {status})")
        return out


class Int8Matmul:
    """ctypes wrappers of kernels/int8_matmul.c: int8 x int8 matmuls of weights and activations
    rotated blockwise (formats there; built by layers/linear.py Int8Rotated). Loaded at every
    native level (docs/kernels.md)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        self._quantize, self._matmul = lib.rotate_quantize_rows_bf16, lib.int8_matmul_bf16_given_max
        self._row_max = lib.rotated_row_max_bf16
        self._quantize.restype, self._quantize.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, p, i, p]
        self._row_max.restype, self._row_max.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, i]
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [p, ctypes.c_long, i, i, p, p, p, i, p, i, p]

    def rotated_row_max(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's largest |value| after the blockwise Hadamard transform: what `__call__`
        scales the row's int8 rounding by. x [T, K] bf16, K a multiple of 32 -> [T] float32."""
        x = self._check_activations(x)
        row_max = torch.empty(x.shape[0], dtype=torch.float32)
        status = self._row_max(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], row_max.data_ptr(), torch.get_num_threads()
        )
        if status:
            raise RuntimeError(f"int8 activation kernel failed (status {status})")
        return row_max

    @staticmethod
    def _check_given_max(given_max: torch.Tensor | None, rows: int) -> None:
        ok = given_max is None or (
            given_max.dtype == torch.float32 and given_max.shape == (rows,) and given_max.is_contiguous()
        )
        if not ok:
            raise ValueError("int8 activations: given_max must be [T] float32, one maximum per row")

    @staticmethod
    def _check_activations(x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype != torch.bfloat16 or x.shape[-1] % 32:
            raise ValueError("int8 activations: x must be [T, K] bfloat16 with K a multiple of 32")
        return x

    def quantize(
        self, x: torch.Tensor, given_max: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation rounding of `__call__`, alone: x [T, K] bf16 (any row stride, K a
        multiple of 32) -> (q [T, K] int8, scale [T] float32), x H ~ q * scale per row, H the
        blockwise Hadamard transform; given_max as `__call__`'s."""
        x = self._check_activations(x)
        rows, k = x.shape
        self._check_given_max(given_max, rows)
        q = torch.empty((rows, k), dtype=torch.int8)
        scale = torch.empty(rows, dtype=torch.float32)
        status = self._quantize(
            x.data_ptr(),
            x.stride(0),
            rows,
            k,
            q.data_ptr(),
            scale.data_ptr(),
            torch.get_num_threads(),
            None if given_max is None else given_max.data_ptr(),
        )
        if status:
            raise RuntimeError(f"int8 activation kernel failed (status {status})")
        return q, scale

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        colsum: torch.Tensor,
        scale: torch.Tensor,
        n: int,
        given_max: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y [T, n] bf16 = x W^T for W in the kernel's panels (packed [n_pad / 64, K / 4, 64, 4]
        int8, colsum int32 and scale float32 [n_pad]); x [T, K] bf16, any row stride.
        given_max [T] float32: each row rounded against that maximum instead of its own
        (rotated_row_max of the whole row, where x holds a tensor-parallel slice of it)."""
        self._check_given_max(given_max, x.shape[0])
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        n_pad = packed.shape[0] * 64
        ok = x.dtype == torch.bfloat16 and packed.dtype == torch.int8 and packed.is_contiguous()
        ok = (
            ok
            and packed.shape[1:] == (k // 4, 64, 4)
            and n <= n_pad
            and colsum.numel() == scale.numel() == n_pad
        )
        if not ok:
            raise ValueError("int8 matmul: x [T, K] bf16 and weights in the kernel's panels")
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        status = self._matmul(
            x.data_ptr(),
            x.stride(0),
            rows,
            k,
            packed.data_ptr(),
            colsum.data_ptr(),
            scale.data_ptr(),
            n,
            out.data_ptr(),
            torch.get_num_threads(),
            None if given_max is None else given_max.data_ptr(),
        )
        if status:
            raise RuntimeError(f"int8 matmul kernel failed (status {status})")
        return out


# kernels/decode_step.c `qlinear.kind`: the weight format of one projection
QLINEAR_Q8, QLINEAR_Q4, QLINEAR_BF16, QLINEAR_I8, QLINEAR_AMX = 0, 1, 2, 3, 4


class QLinearDesc(ctypes.Structure):
    """kernels/decode_step.c `qlinear`: one projection's weights (kind: QLINEAR_*; d and m
    only for the quantized kinds: Q4/Q8 scales (m only for Q4), I8 column sums and scales)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("lora_a", ctypes.c_void_p),
        ("lora_b", ctypes.c_void_p),
        ("lora_bounds", ctypes.c_void_p),
        ("lora_parts", ctypes.c_int),
        ("lora_max_rank", ctypes.c_int),
    ]


class DecoderLayerDesc(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", QLinearDesc),
        ("o", QLinearDesc),
        ("gate_up", QLinearDesc),
        ("down", QLinearDesc),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
    ]


class DecoderModelDesc(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayerDesc)),
        ("final_norm", ctypes.c_void_p),
        ("num_layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("window", ctypes.c_int),
        ("kv_int8", ctypes.c_int),
        ("part_keys", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class StepRowsDesc(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("row_seq", ctypes.c_void_p),
        ("row_pos", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("max_blocks", ctypes.c_int),
        ("lora_row_slot", ctypes.c_void_p),
        ("lora_rank", ctypes.c_int),
    ]


def step_rows(
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    rows: int,
    *,
    num_slots: int,
    block_size: int,
    lora_row_slot: torch.Tensor | None = None,
    lora_rank: int = 0,
) -> StepRowsDesc:
    """The C step's rows (raw pointers: the caller keeps the tensors alive for the call). With
    debug checks on, their indices are range-checked here, the last place that knows the bounds."""
    if DEBUG_CHECKS:
        check_slots(slots, rows, num_slots)
        check_paged_indices(block_tables, row_seq, row_pos, rows, num_slots, block_size)
    return StepRowsDesc(
        slots.data_ptr(),
        block_tables.data_ptr(),
        row_seq.data_ptr(),
        row_pos.data_ptr(),
        rows,
        block_tables.shape[1],
        data_ptr_or_none(lora_row_slot),
        lora_rank,
    )


class DecodeStepKernel:
    """kernels/decode_step.c: every layer of a small step in one call. The descriptors hold raw
    pointers; fornax/models/native_step.py builds them and keeps their tensors alive."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.decode_step_f32, torch.bfloat16: lib.decode_step_bf16}
        p = ctypes.c_void_p
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.POINTER(DecoderModelDesc),
                p,
                p,
                p,
                ctypes.POINTER(StepRowsDesc),
                p,
                ctypes.c_int,
            ]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self,
        model: DecoderModelDesc,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: StepRowsDesc,
    ) -> torch.Tensor:
        """x: [rows, hidden] contiguous embeddings; cos, sin: [rows, head_dim] contiguous, x's dtype.
        Returns the hidden states after the final norm, [rows, hidden]."""
        out = torch.empty_like(x)
        status = self._fns[x.dtype](
            ctypes.byref(model),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            ctypes.byref(rows),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"native decode step failed (status {status})")
        return out


_LIBRARY_LOCK = threading.Lock()


def _library() -> ctypes.CDLL | None:
    """Built and loaded once per process; the lock makes that once even when threads race here,
    so the warning of a failure is said once too. Processes racing each other both build to
    temporary files and rename atomically (_build): a second compile, never a broken library."""
    with _LIBRARY_LOCK:
        return _library_once()


# The level the loaded library was built for (set once, by _library_once).
_LOADED_LEVEL: isa.Choice | None = None


@functools.cache
def _library_once() -> ctypes.CDLL | None:
    global _LOADED_LEVEL
    choice = isa.current()  # a FORNAX_ISA the CPU cannot run raises ConfigError: not a fallback
    try:
        path = _build(choice)
        try:
            lib = ctypes.CDLL(str(path))
            _LOADED_LEVEL = choice
            return lib
        except OSError as exc:  # e.g. a runtime library (libgomp) missing at load time
            raise KernelsUnavailable(f"cannot load {path.name}: {_one_line(str(exc))}") from exc
    except KernelsUnavailable as exc:
        logger.warning("native kernels unavailable (%s); using torch ops", exc)
        return None


def library_level() -> isa.Choice | None:
    """The level of the kernels library this process loaded (building it if needed); None where
    there is none (no compiler, no writable cache: torch ops)."""
    return _LOADED_LEVEL if _library() is not None else None


@functools.cache
def load_paged_attention() -> PagedAttentionKernel | None:
    """The compiled attention kernel, or None when it cannot be built here (then torch ops are used)."""
    lib = _library()
    return None if lib is None else PagedAttentionKernel(lib)


def _wrap_if_available(available: str, wrapper: Callable[[ctypes.CDLL], T]) -> T | None:
    """`wrapper(lib)` where the library was built and its `available()` flag says the kernels
    were compiled in for this CPU; None otherwise."""
    lib = _library()
    return None if lib is None or not getattr(lib, available)() else wrapper(lib)


@functools.cache
def load_quant_matmul() -> QuantMatmul | None:
    """The integer-dot-product matmuls, or None where they cannot run here (no AVX2/AVX-512/NEON
    level, no compiler)."""
    return _wrap_if_available("quant_matmul_available", QuantMatmul)


@functools.cache
def load_bf16_matmul() -> Bf16Matmul | None:
    """The bf16 small-step matmul, or None where it cannot run here (no native level, no compiler)."""
    return _wrap_if_available("bf16_matmul_available", Bf16Matmul)


@functools.cache
def load_f32_matmul() -> F32Matmul | None:
    """The fixed-order float32 matmul, or None where it cannot run here (no native level, no compiler)."""
    return _wrap_if_available("f32_matmul_available", F32Matmul)


@functools.cache
def load_lora_kernel() -> LoRAKernel | None:
    """The per-row LoRA products, or None where the library cannot be built here."""
    return _wrap_if_available("lora_available", LoRAKernel)


@functools.cache
def load_amx_bf16_matmul() -> AmxBf16Matmul | None:
    """The AMX bf16 matmul, or None where it cannot run here (no AMX-BF16, an OS that does not
    grant the tile state, no compiler)."""
    return _wrap_if_available("amx_bf16_available", AmxBf16Matmul)


@functools.cache
def load_int8_matmul() -> Int8Matmul | None:
    """The int8 x int8 matmul, or None where it cannot run here (no native level, no compiler)."""
    return _wrap_if_available("int8_matmul_available", Int8Matmul)


@functools.cache
def load_decode_step() -> DecodeStepKernel | None:
    """The one-call small step, or None where the integer kernels it uses cannot run here."""
    lib = _library()  # it calls the integer matmuls, so it runs exactly where they do
    return None if lib is None or load_quant_matmul() is None else DecodeStepKernel(lib)


@functools.cache
def load_fused_ops() -> FusedOps | None:
    """The compiled elementwise ops, or None when they cannot be built here."""
    lib = _library()
    return None if lib is None else FusedOps(lib)
