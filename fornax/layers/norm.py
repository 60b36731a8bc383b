"""RMSNorm, computed in float32 like the reference implementation."""

from __future__ import annotations

import torch
from torch import nn

from fornax.layers.native import FusedOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused: FusedOps | None = None  # set by LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps)[0]
        # Normalize in fp32 and cast back before the weight: the order HF uses, which
        # matters for bit-level agreement in bf16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual (s = x when residual is None): the residual add of
        a decoder layer and the next norm in one call, rounded exactly as the two torch ops."""
        if residual is None:
            return self(x), x
        if self.fused is not None and x.dim() == 2:
            out, summed = self.fused.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return out, summed
        summed = x + residual
        return self(summed), summed
