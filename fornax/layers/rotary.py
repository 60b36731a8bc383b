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
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "longrope":  # the short factors; RotaryEmbedding keeps the long ones beside them
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise ValueError(f"unsupported RoPE scaling {kind!r}")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (1 for every other rule): the given
    `attention_factor`; else YaRN's 0.1 ln(factor) + 1 (or the ratio of two such with `mscale`
    and `mscale_all_dim`, DeepSeek's), LongRoPE's sqrt(1 + ln(factor) / ln(trained context))."""
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN (as transformers computes it, for Qwen2.5/Qwen3's long contexts): frequencies that
    turn fewer than beta_slow times over the original context are divided by `factor`, those
    that turn more than beta_fast times are kept, and a linear ramp blends the dimensions between."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1 - (1 - ramp) below, as transformers writes it: not ramp's bits
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
        self.attention_factor = rope_attention_factor(scaling)  # YaRN's and LongRoPE's; 1 otherwise
        # LongRoPE (Phi-3): the long factors serve every token of a sequence longer than the
        # trained context, as transformers picks them per forward call by the sequence's length
        self.long: RotaryEmbedding | None = None
        self.long_after = 0
        if scaling is not None and scaling.get("rope_type") == "longrope" and scaling.get("long_factor"):
            # two tables of every position would be ~200 MB at Phi-3's 128k: computed per step
            precompute = False
            long = {**scaling, "short_factor": scaling["long_factor"], "long_factor": None}
            self.long = RotaryEmbedding(head_dim, max_positions, theta, long, precompute)
            self.long_after = int(scaling["original_max_position_embeddings"])
        if precompute:
            emb = self._angles(torch.arange(max_positions, dtype=torch.int64))  # [max_positions, head_dim]
            self.register_buffer("cos", self._scaled(emb.cos()), persistent=False)
            self.register_buffer("sin", self._scaled(emb.sin()), persistent=False)
        self.precompute = precompute

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(positions.float(), self.inv_freq)  # [T, head_dim // 2]
        return torch.cat((freqs, freqs), dim=-1)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.attention_factor == 1.0 else x * self.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin [num_tokens, head_dim], made once per step and shared by all layers.
        seq_lens: each token's sequence length after the step (AttentionMetadata.seq_lens), for
        LongRoPE; without it a token's own position + 1 stands in."""
        if self.long is not None:
            lengths = positions + 1 if seq_lens is None else seq_lens
            use_long = (lengths > self.long_after)[:, None]
            short, long = self._cos_sin(positions, dtype), self.long._cos_sin(positions, dtype)
            return torch.where(use_long, long[0], short[0]), torch.where(use_long, long[1], short[1])
        return self._cos_sin(positions, dtype)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.precompute:
            emb = self._angles(positions)
            return self._scaled(emb.cos()).to(dtype), self._scaled(emb.sin()).to(dtype)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
