"""GGUF tensors to floats with torch ops: bit for bit what the `gguf` package's dequantizers give.

Why not `gguf.quants.dequantize` itself: it is numpy over small groups of rows, one thread,
and it returns float32 that the loader then rounds to the model's dtype in a second pass. On
the default model (SmolLM2-135M, Q4_1) it took most of a load's time (3.4 s of a 9.5 s load on
2 busy cores), and every engine, tensor-parallel rank and server start pays it. The same
arithmetic as torch ops runs vectorized over both cores, and in slices of rows, so a slice's
float32 values are rounded into the output before the next is made: no whole float32 copy of
the tensor is ever held (for a 1B model's embedding table, 1 GiB less at peak).

Exactness: each type's values are computed in float32 with the reference's operations in its
order (for example Q4_1 is `d * q + m`, a product rounded before the sum; torch's eager ops
never fuse them into an FMA), so the results equal gguf's bit for bit, which
tests/model/test_gguf_loading.py checks on random blocks of every type. The block layouts are
ggml's (ggml-common.h); other types than these go through the `gguf` package.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256  # values in a K-quant super-block
SLICE_VALUES = 1 << 22  # values dequantized per slice: 16 MiB of float32 at a time


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """[blocks, groups * n] bytes -> [blocks, groups, 2n] values: each group's low nibbles, then
    its high ones (ggml's order within a group of packed bytes)."""
    b = packed.reshape(packed.shape[0], groups, -1)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _bits(packed: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """[blocks, groups * n] bytes -> [blocks, groups * 8 // width, n] fields of `width` bits:
    field k of every byte, for k from the lowest bits up (ggml's high-bit and Q6_K layouts)."""
    b = packed.reshape(packed.shape[0], groups, 1, -1)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).view(1, 1, -1, 1)
    fields = (b >> shifts) & ((1 << width) - 1)
    return fields.reshape(packed.shape[0], -1, packed.shape[1] // groups)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _high_bits_32(b: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1: bit i of the little-endian uint32 at `start` is value i's fifth bit, so
    value 8j + k takes bit k of byte j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[:, start : start + 4].unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 6:], 1).reshape(b.shape[0], 32)
    q = (low | (_high_bits_32(b, 2) << 4)).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 8:], 1).reshape(b.shape[0], 32)
    q = (low | (_high_bits_32(b, 4) << 4)).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 six-bit scales and mins packed in 12 bytes, as [blocks, 8] each."""
    s = scales.reshape(scales.shape[0], 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's values from their [blocks, 8, 32] quants: d * scale * q - dmin * min."""
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(b.shape[0], QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _nibbles(b[:, 16:], 4).reshape(b.shape[0], 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:], 4).reshape(b.shape[0], 8, 32)
    high = _bits(b[:, 16:48].contiguous(), 1, 1)  # [blocks, 8, 32]: bit j of byte i -> value 32j + i
    return _k_scaled(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 2).reshape(n, 2, 2, 64).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].contiguous(), 2, 2)  # [blocks, 8, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).unsqueeze(-1)
    return (d * q).reshape(n, QK_K)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


BLOCK_DEQUANTIZERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.BF16: _bf16,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor's values in `dtype`, shaped as the file's rows: `data` is the tensor as
    gguf_file.GGUFTensor holds it (typed for F32/F16, else rows of packed blocks), and the result
    equals torch.from_numpy(gguf.quants.dequantize(data, qtype)).to(dtype) bit for bit."""
    if qtype in (Q.F32, Q.F16):  # a copy: `data` may be a read-only view of the file map
        return torch.from_numpy(np.array(data, dtype=np.float32)).to(dtype)
    fn = BLOCK_DEQUANTIZERS.get(qtype)
    if fn is None:  # a type this module does not carry: the reference, then the rounding
        from gguf.quants import dequantize as reference

        return torch.from_numpy(np.ascontiguousarray(reference(data, qtype), dtype=np.float32)).to(dtype)
    values, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = data.shape[-1]
    rows = data.size // row_bytes
    width = row_bytes // block_bytes * values
    with warnings.catch_warnings():  # a read-only file map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).reshape(rows, row_bytes)
    out = torch.empty(rows, width, dtype=dtype)
    step = max(1, SLICE_VALUES // width)
    for start in range(0, rows, step):
        part = raw[start : start + step]
        blocks = part.reshape(-1, block_bytes)
        out[start : start + step] = fn(blocks).reshape(part.shape[0], width)
    return out.reshape(*data.shape[:-1], width)
