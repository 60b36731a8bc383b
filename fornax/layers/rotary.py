"""Rotary position embedding (half-split layout, as in HF), with RoPE scaling variants."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after any scaling rule."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported RoPE scaling {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin per position: precomputed for every position and gathered by position, or (with
    precompute=False) computed for the step's positions, for models whose table would be large
    (Gemma 3: two tables of 32k positions x 256 values, 128 MiB). Both give the same bits:
    position * inv_freq in float32, then cos and sin."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        precompute: bool = True,
    ) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [head_dim // 2] float32
        if precompute:
            emb = self._angles(torch.arange(max_positions, dtype=torch.int64))  # [max_positions, head_dim]
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
        self.precompute = precompute

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(positions.float(), self.inv_freq)  # [T, head_dim // 2]
        return torch.cat((freqs, freqs), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin [num_tokens, head_dim], made once per step and shared by all layers."""
        if not self.precompute:
            emb = self._angles(positions)
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
