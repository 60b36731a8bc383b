"""One layer's paged K/V pools, in the model's dtype or as int8 rows with scales.

Slots are flat (block_id * block_size + offset); each pool is [num_slots, num_kv_heads,
head_dim]. With `--kv-cache-dtype int8` every (slot, KV head) row of head_dim values is
stored as int8 with one float32 scale, row = int8 * scale (symmetric, scale = max|x| / 127).

Why int8: at long context a decode step's attention reads every cached K/V row from memory,
and half the bytes made a 2,000-token step 1.15-1.19x faster (docs/kernels.md, "int8 KV cache"; it
paid only once the kernel's int8 scoring was cheap, see paged_attention.c). One scale per
head row (64 values for the default model) follows the row's own range, as llama.cpp's q8_0
cache does with blocks of 32. Each row costs head_dim + 4 bytes instead of 2 * head_dim.

`quantize_rows` is the torch twin of kernels/paged_attention.c kv_store_i8_*, which writes
the rows wherever the kernels are loaded: the same operations in the same order, so both
write the same bits (tests/model/test_native_kernels.py checks it, ties included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fornax.layers import hugepages


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [...]): round-to-nearest-even of x / scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows stay zero
    q = torch.round(xf / divisor.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """K and V of one token in one layer."""
    if kv_cache_dtype == "int8":
        return 2 * num_kv_heads * (head_dim + 4)  # int8 values + a float32 scale per head row
    return 2 * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class LayerKV:
    k: torch.Tensor  # [num_slots, Hkv, D]: the model's dtype, or int8
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_slots, Hkv] float32 for int8 pools
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str
    ) -> LayerKV:
        return cls.allocate_layers(1, num_slots, num_kv_heads, head_dim, dtype, kv_cache_dtype)[0]

    @classmethod
    def allocate_layers(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
    ) -> list[LayerKV]:
        """Every layer's pools in one mapping (hugepages.zeros_many), zero-filled by the kernel as
        pages are first written: the pools cost memory only as requests fill them, and slot 0,
        the gather target of padding, reads zeros (padding must never multiply garbage: NaN * 0
        = NaN). On huge pages: K/V rows are read scattered by block (layers/hugepages.py)."""
        shape = (num_slots, num_kv_heads, head_dim)
        quantized = kv_cache_dtype == "int8"
        per_layer = [(shape, torch.int8 if quantized else dtype)] * 2
        if quantized:
            per_layer += [(shape[:2], torch.float32)] * 2
        flat = hugepages.zeros_many(per_layer * num_layers)
        n = len(per_layer)
        return [cls(*flat[i * n : (i + 1) * n]) for i in range(num_layers)]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows k, v ([T, Hkv, D]) at slots ([T])."""
        if self.k_scale is None or self.v_scale is None:
            self.k.index_copy_(0, slots, k)
            self.v.index_copy_(0, slots, v)
            return
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_rows(x)
            pool.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, s)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at slots (any shape S): [*S, Hkv, D] in dtype."""
        if self.k_scale is None or self.v_scale is None:
            return self.k[slots], self.v[slots]
        return (
            dequantize_rows(self.k[slots], self.k_scale[slots], dtype),
            dequantize_rows(self.v[slots], self.v_scale[slots], dtype),
        )
