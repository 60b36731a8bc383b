"""GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) unpacked into the int4 kernels' form, the 4-bit
values and per-32 scales unchanged (models/loader.py's Int4Blocks; docs/kernels.md)."""

from __future__ import annotations

import numpy as np


def q4_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of packed Q4_0 / Q4_1 blocks -> (q [rows, cols] uint8, scale, zero [rows, cols / 32]).

    A block is an f16 scale d (Q4_1: then an f16 minimum m) and 16 bytes holding 32 4-bit
    values: the low nibbles are elements 0-15, the high nibbles elements 16-31 (ggml's layout)."""
    header = 4 if type_name == "Q4_1" else 2
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)
    packed = blocks[..., header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        return q, d, m + 8.0 * d
    return q, d, np.zeros_like(d)


def q4k_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q4_K super-blocks -> the same (q, scale, zero) form per 32 values as q4_blocks.

    A super-block of 256 values is f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales sc and
    minimums mn (eight of each, bit-packed), then 128 bytes of 4-bit q: each 32 bytes hold two
    sub-blocks, the low nibbles the first, the high nibbles the second. Value = d * sc * q -
    dmin * mn, which is (q - 8) * scale + zero with scale = d * sc, zero = 8 * scale - dmin * mn:
    the int4 kernels' form, the 4-bit values unchanged."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 144)
    d = blocks[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)[..., None]  # [rows, nb, 1]
    dmin = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)[..., None]
    packed_scales = blocks[..., 4:16].astype(np.uint8)
    low, high = packed_scales[..., 0:4], packed_scales[..., 4:8]
    tail = packed_scales[..., 8:12]
    # sub-blocks 0-3: low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7: the nibbles
    # of bytes 8-11, with their top two bits from the top of bytes 0-3 (scale) and 4-7 (min)
    sc = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mn = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 pairs of sub-blocks, 32 bytes each
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1)  # [rows, cols]
    scale = (d * sc).reshape(rows, -1)  # [rows, cols / 32]
    minimum = (dmin * mn).reshape(rows, -1)
    return q, scale, 8.0 * scale - minimum


# GGUF types whose blocks the int4 kernels take as they are (the 4-bit values, per-32 scales)
INT4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")
