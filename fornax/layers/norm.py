"""RMSNorm, computed in float32 like the reference implementation (layers/ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from fornax.layers.ops import TORCH_OPS, LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops: LayerOps = TORCH_OPS  # set by LlamaForCausalLM.use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual (s = x when residual is None): the residual add of
        a decoder layer and the next norm in one call, rounded exactly as the two torch ops."""
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
