"""The elementwise ops of a decoder layer behind one interface, with two implementations.

`TorchOps` is the reference: the exact torch expressions HF uses (the order of casts matters
for bit-level agreement in bf16). `NativeOps` runs the same expressions as one native call
each (layers/kernels/fused_ops.c), rounding where torch rounds, and hands anything its
kernels do not cover (another dtype, a layout that is not rows) to `TorchOps`. Layers hold
one of them and call it unconditionally (docs/architecture.md, rule 8); `layer_ops(backend, dtype)` picks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from fornax.layers.native import FusedOps, load_fused_ops
from fornax.layers.rotary import apply_rotary


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * cast(x * rsqrt(mean(x^2) + eps)), computed in float32."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s), s) with s = x + residual: a residual add and the norm after it."""
        ...

    def rms_norm_f32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """cast(x * rsqrt(mean(x^2) + eps) * weight), all in float32 with a float32 weight (Gemma)."""
        ...

    def rotary_(self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first num_heads heads of each row of x [T, >= num_heads * D] (HF's half-split
        layout); cos, sin: [T, D]. May work in place; returns the rotated [T, num_heads, D]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dim."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (Gemma's GeGLU) for gate_up = [gate | up] along the last dim."""
        ...


class TorchOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalize in fp32 and cast back before the weight: the order HF uses.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rms_norm_f32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * weight).to(x.dtype)

    def rotary_(self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, d = cos.shape
        heads = x[:, : num_heads * d].view(t, num_heads, d)  # [T, H, D]
        return apply_rotary(heads, cos[:, None], sin[:, None])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class NativeOps:
    def __init__(self, fused: FusedOps) -> None:
        self.fused, self.fallback = fused, TorchOps()

    def _covers(self, *tensors: torch.Tensor) -> bool:
        return all(t.dim() == 2 and t.stride(-1) == 1 and self.fused.supports(t.dtype) for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._covers(x):  # e.g. Qwen3's per-head Q/K norms on [T, H, D]
            return self.fallback.rms_norm(x, weight, eps)
        return self.fused.rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._covers(x, residual):
            return self.fallback.add_rms_norm(x, residual, weight, eps)
        out, summed = self.fused.rms_norm(x, weight, eps, residual)
        assert summed is not None
        return out, summed

    def rms_norm_f32_weight(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # per-head norms ([T, H, D]) as rows of D
        if not self._covers(rows):
            return self.fallback.rms_norm_f32_weight(x, weight, eps)
        return self.fused.rms_norm_f32_weight(rows, weight, eps).view(x.shape)

    def rotary_(self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self._covers(x):
            return self.fallback.rotary_(x, num_heads, cos, sin)
        self.fused.rotary_(x, num_heads, cos, sin)
        return x[:, : num_heads * cos.shape[1]].view(x.shape[0], num_heads, cos.shape[1])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._covers(gate_up):
            return self.fallback.silu_mul(gate_up)
        return self.fused.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fallback.gelu_tanh_mul(gate_up)  # no native kernel yet: torch's, exactly

    def __deepcopy__(self, memo: dict) -> NativeOps:
        return self  # stateless; a model copy (self-drafting) shares it


TORCH_OPS = TorchOps()


def layer_ops(backend: str, dtype: torch.dtype) -> LayerOps:
    """ "native": the compiled kernels when they build here and cover `dtype`; else torch ops."""
    if backend == "native":
        fused = load_fused_ops()
        if fused is not None and fused.supports(dtype):
            return NativeOps(fused)
    return TORCH_OPS
