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
each other on 2 cores). Where no compiler is found or the build fails, the loaders return
None and the layers use torch ops; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fornax.config import fornax_home
from fornax.layers.kv_pool import LayerKV

KERNEL_DIR = Path(__file__).with_name("kernels")
T = TypeVar("T")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(compiler: str) -> Path:
    sources = sorted(KERNEL_DIR.glob("*.c"))
    digest = hashlib.sha256(" ".join(FLAGS).encode() + _cpu_signature().encode())
    for path in sorted(KERNEL_DIR.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = fornax_home() / "kernels"
    target = out_dir / f"fornax_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, *map(str, sources), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class PagedAttentionKernel:
    """ctypes wrapper; all pointer arguments are checked tensors, so a call cannot read out of bounds
    unless the block tables themselves are wrong (they come from the KV manager)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        # (query dtype, int8 pools?) -> entry point
        self._fns = {
            (torch.float32, False): lib.paged_attention_f32, (torch.bfloat16, False): lib.paged_attention_bf16,
            (torch.float32, True): lib.paged_attention_f32_i8, (torch.bfloat16, True): lib.paged_attention_bf16_i8,
        }  # fmt: skip
        p, i, lg, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [p, lg, p, p, p, p, p, p, i, p, p, i, i, i, i, i, f, i, i]
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
    ) -> torch.Tensor:
        rows, heads, dim = q.shape
        pools = cache.tensors()
        if q.stride(2) != 1 or q.stride(1) != dim or not all(t.is_contiguous() for t in pools):
            raise ValueError("paged attention kernel: unexpected memory layout")
        if cache.k.dtype != (torch.int8 if cache.quantized else q.dtype):
            raise ValueError(f"paged attention kernel: {cache.k.dtype} pools for {q.dtype} queries")
        for t in (block_tables, row_seq, row_pos):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("paged attention kernel: index tensors must be contiguous int32")
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        status = self._fns[(q.dtype, cache.quantized)](
            q.data_ptr(), q.stride(0), cache.k.data_ptr(), cache.v.data_ptr(), data_ptr_or_none(cache.k_scale),
            data_ptr_or_none(cache.v_scale), out.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            row_seq.data_ptr(), row_pos.data_ptr(), rows, heads, cache.k.shape[1], dim, block_size, scale,
            window or 0, torch.get_num_threads(),
        )  # fmt: skip
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
        for x, pool, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            self._store_i8[k.dtype](
                x.data_ptr(), x.stride(0), x.shape[0], slots.data_ptr(), x.shape[1], x.shape[2], pool.data_ptr(),
                data_ptr_or_none(scales),
            )  # fmt: skip
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
        if not _row_view_ok(x) or (residual is not None and (residual.shape != x.shape or not _row_view_ok(residual))):
            raise ValueError("rms_norm kernel: inputs must be [rows, dim] with contiguous rows")
        if not weight.is_contiguous() or weight.dtype != x.dtype or weight.numel() != dim:
            raise ValueError("rms_norm kernel: weight must be a contiguous [dim] of the input's dtype")
        out = torch.empty((rows, dim), dtype=x.dtype)
        summed = None if residual is None else torch.empty((rows, dim), dtype=x.dtype)
        self._norm[x.dtype](
            x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), None if summed is None else summed.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, dim, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, summed

    def rotary_(self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first num_heads heads of each row of x [rows, >= num_heads * head_dim];
        cos, sin: [rows, head_dim] contiguous, x's dtype."""
        rows, head_dim = cos.shape
        if not _row_view_ok(x) or x.shape[0] != rows or x.shape[1] < num_heads * head_dim:
            raise ValueError("rotary kernel: x must be [rows, >= num_heads * head_dim] with contiguous rows")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype):
            raise ValueError("rotary kernel: cos and sin must be contiguous, in x's dtype")
        self._rotary[x.dtype](
            x.data_ptr(), x.stride(0), rows, num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
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
    (formats there; built by layers/linear.py). Only loaded where the CPU has AVX-512 VNNI."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self._fns = {
            ("q4", torch.float32): lib.q4_matmul_f32, ("q4", torch.bfloat16): lib.q4_matmul_bf16,
            ("q8", torch.float32): lib.q8_matmul_f32, ("q8", torch.bfloat16): lib.q8_matmul_bf16,
        }  # fmt: skip
        for fn in self._fns.values():
            fn.restype, fn.argtypes = ctypes.c_int, [p, lg, i, i, p, p, p, i, p, i]

    MAX_ROWS = 64  # the kernel's limit on activation rows per call (quant_matmul.c MAX_ROWS)

    def __call__(
        self, fmt: str, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, n: int
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
                x[r0].data_ptr(), x.stride(0), r1 - r0, k, qweight.data_ptr(), scale.data_ptr(),
                None if offset is None else offset.data_ptr(), n, out[r0].data_ptr(), threads,
            )  # fmt: skip
            if status:
                raise RuntimeError(f"quantized matmul kernel failed (status {status})")
        return out


class Bf16Matmul:
    """ctypes wrapper of kernels/bf16_matmul.c: y = x W^T for a bf16 Linear's own weight, for
    steps of a few rows. Only loaded where the CPU has AVX-512 BF16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        self._fn = lib.bf16_matmul_bf16
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, i, p, i]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y [T, N] = x W^T; x: [T, K] bf16 (any row stride), weight: [N, K] bf16 contiguous."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n, k = weight.shape
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.shape[1] != k or not weight.is_contiguous():
            raise ValueError("bf16 matmul: x [T, K] and a contiguous weight [N, K], both bfloat16")
        out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        status = self._fn(
            x.data_ptr(), x.stride(0), x.shape[0], k, weight.data_ptr(), n, out.data_ptr(), torch.get_num_threads()
        )
        if status:
            raise RuntimeError(f"bf16 matmul kernel failed (status {status})")
        return out


class Int8Matmul:
    """ctypes wrappers of kernels/int8_matmul.c: int8 x int8 matmuls of weights and activations
    rotated blockwise (formats there; built by layers/linear.py Int8Rotated). Only loaded where
    the CPU has AVX-512 VNNI."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int
        self._quantize, self._matmul = lib.rotate_quantize_rows_bf16, lib.int8_matmul_bf16
        self._quantize.restype, self._quantize.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, p, i]
        self._matmul.restype, self._matmul.argtypes = ctypes.c_int, [p, ctypes.c_long, i, i, p, p, p, i, p, i]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation rounding of `__call__`, alone: x [T, K] bf16 (any row stride, K a
        multiple of 32) -> (q [T, K] int8, scale [T] float32), x H ~ q * scale per row, H the
        blockwise Hadamard transform."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        if x.dtype != torch.bfloat16 or k % 32:
            raise ValueError("int8 activations: x must be [T, K] bfloat16 with K a multiple of 32")
        q = torch.empty((rows, k), dtype=torch.int8)
        scale = torch.empty(rows, dtype=torch.float32)
        status = self._quantize(x.data_ptr(), x.stride(0), rows, k, q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
        if status:
            raise RuntimeError(f"int8 activation kernel failed (status {status})")
        return q, scale

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, colsum: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        """y [T, n] bf16 = x W^T for W in the kernel's panels (packed [n_pad / 64, K / 4, 64, 4]
        int8, colsum int32 and scale float32 [n_pad]); x [T, K] bf16, any row stride."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        n_pad = packed.shape[0] * 64
        ok = x.dtype == torch.bfloat16 and packed.dtype == torch.int8 and packed.is_contiguous()
        ok = ok and packed.shape[1:] == (k // 4, 64, 4) and n <= n_pad and colsum.numel() == scale.numel() == n_pad
        if not ok:
            raise ValueError("int8 matmul: x [T, K] bf16 and weights in the kernel's panels")
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        status = self._matmul(
            x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(), colsum.data_ptr(), scale.data_ptr(), n,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"int8 matmul kernel failed (status {status})")
        return out


# kernels/decode_step.c `qlinear.kind`: the weight format of one projection
QLINEAR_Q8, QLINEAR_Q4, QLINEAR_BF16, QLINEAR_I8 = 0, 1, 2, 3


class QLinearDesc(ctypes.Structure):
    """kernels/decode_step.c `qlinear`: one projection's weights (kind: QLINEAR_*; d and m
    only for the quantized kinds: Q4/Q8 scales (m only for Q4), I8 column sums and scales)."""

    _fields_ = [
        ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int), ("k", ctypes.c_int), ("kind", ctypes.c_int),
    ]  # fmt: skip


class DecoderLayerDesc(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("qkv", QLinearDesc), ("o", QLinearDesc), ("gate_up", QLinearDesc), ("down", QLinearDesc),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
    ]  # fmt: skip


class DecoderModelDesc(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayerDesc)), ("final_norm", ctypes.c_void_p),
        ("num_layers", ctypes.c_int), ("hidden", ctypes.c_int), ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int),
        ("block_size", ctypes.c_int), ("window", ctypes.c_int), ("kv_int8", ctypes.c_int),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
    ]  # fmt: skip


class StepRowsDesc(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("row_seq", ctypes.c_void_p),
        ("row_pos", ctypes.c_void_p), ("rows", ctypes.c_int), ("max_blocks", ctypes.c_int),
    ]  # fmt: skip


class DecodeStepKernel:
    """kernels/decode_step.c: every layer of a small step in one call. The descriptors hold raw
    pointers; fornax/models/native_step.py builds them and keeps their tensors alive."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.decode_step_f32, torch.bfloat16: lib.decode_step_bf16}
        p = ctypes.c_void_p
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(DecoderModelDesc), p, p, p, ctypes.POINTER(StepRowsDesc), p, ctypes.c_int]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self, model: DecoderModelDesc, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: StepRowsDesc
    ) -> torch.Tensor:
        """x: [rows, hidden] contiguous embeddings; cos, sin: [rows, head_dim] contiguous, x's dtype.
        Returns the hidden states after the final norm, [rows, hidden]."""
        out = torch.empty_like(x)
        status = self._fns[x.dtype](
            ctypes.byref(model), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), ctypes.byref(rows), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"native decode step failed (status {status})")
        return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Built and loaded once per process. Two threads racing here both build to temporary files
    and rename atomically (_build), so a race costs a second compile, never a broken library."""
    return _try_load()


def _try_load() -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError):
        return None


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
    """The integer-dot-product matmuls, or None where they cannot run here (no VNNI, no compiler)."""
    return _wrap_if_available("quant_matmul_available", QuantMatmul)


@functools.cache
def load_bf16_matmul() -> Bf16Matmul | None:
    """The bf16 small-step matmul, or None where it cannot run here (no AVX-512 BF16, no compiler)."""
    return _wrap_if_available("bf16_matmul_available", Bf16Matmul)


@functools.cache
def load_int8_matmul() -> Int8Matmul | None:
    """The int8 x int8 matmul, or None where it cannot run here (no AVX-512 VNNI, no compiler)."""
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
