"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks a few experts
per token and the layer's output is their weighted sum (config/moe.py has the shape and routing).

Each expert is an ordinary gated MLP whose projections are `Linear`s, so the loader plans and
builds their weight forms (int4, int8, w8a8, dense) exactly as for a dense layer's
(layers/kernel_plan.py). A step groups its tokens by expert: one pair of matmuls per expert
over the rows that chose it, never one per token, and an expert no token chose costs nothing,
so a decode step reads only the chosen experts' weights.

The router stays float32 and dense whatever the step's forms: its logits decide which weights
run at all, so a rounding there would change which experts a token sees rather than a little
of its output (vLLM keeps the gate unquantized for the same reason). With the native kernels
its matmul is the float32 loop of kernels/f32_matmul.c, whose sums for a row do not depend on
the rows beside it, so which experts a token reaches does not depend on its batch (what
deterministic mode needs; torch's float32 linear blocks its sums by the call's shape). Its
softmax, top-k and renormalization are torch's, as in transformers, so ties break the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fornax.config import ModelConfig
from fornax.config.moe import MoEConfig
from fornax.layers.linear import Linear
from fornax.layers.native import F32Matmul, load_f32_matmul
from fornax.layers.ops import TORCH_OPS, LayerOps


class GatedMLP(nn.Module):
    """SiLU(x W_gate) * (x W_up), then W_down: a dense layer's MLP and each expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)
        self.ops: LayerOps = TORCH_OPS  # set by the model's use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))  # gate_up: [T, 2I]


class SparseMoE(nn.Module):
    """A sparse layer's MLP: the router, the experts this process holds, and Qwen2-MoE's shared
    expert with its gate."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        h = config.hidden_size
        self.router = nn.Parameter(torch.empty(moe.num_experts, h, dtype=torch.float32), requires_grad=False)
        # a tensor-parallel rank holds some experts (config/moe.py local_experts); their outputs
        # are partial sums, completed by an all-reduce of the block's output (models/sharding.py)
        self.held = moe.held_experts
        self.experts = nn.ModuleList(GatedMLP(h, moe.expert_intermediate_size, dtype) for _ in self.held)
        self.shared_expert = None
        self.shared_expert_gate = None
        self.router_matmul: F32Matmul | None = None  # set by use_ops with the native kernels
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, moe.shared_expert_intermediate_size, dtype)
            self.shared_expert_gate = nn.Parameter(
                torch.empty(1, h, dtype=torch.float32), requires_grad=False
            )

    def use_ops(self, ops: LayerOps) -> None:
        """Native ops bring the batch-invariant float32 matmul for the router (see above)."""
        self.router_matmul = None if ops is TORCH_OPS else load_f32_matmul()

    def _float_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return F.linear(x, weight) if self.router_matmul is None else self.router_matmul(x, weight)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> each token's top-k expert weights [T, k] (float32) and indices [T, k]."""
        probs = F.softmax(self._float_linear(x, self.router), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        k = self.moe.top_k
        # (token, slot) pairs sorted by expert: each expert's rows are one contiguous run
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        rows, slot_weights = order // k, weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or e not in self.held:  # nobody chose it (not read), or another rank holds it
                start += n
                continue
            idx = rows[start : start + n]
            y = self.experts[e - self.held.start](x[idx]) * slot_weights[start : start + n, None].to(x.dtype)
            out.index_add_(0, idx, y)  # in expert order, as transformers adds them
            start += n
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = _sigmoid_by_element(self._float_linear(x, self.shared_expert_gate)).to(x.dtype)  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out


def _sigmoid_by_element(v: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid with each value's result independent of the tensor's length: torch runs
    whole SIMD vectors through its vectorized exp and the leftover tail through the scalar one,
    which can differ in the last bit, so a token's gate would depend on how many tokens share
    the step (found by deterministic mode's test). Padded to a multiple of 64 values, every
    value takes the vector path."""
    flat = v.reshape(-1)
    pad = -flat.numel() % 64
    return torch.sigmoid(F.pad(flat, (0, pad)))[: flat.numel()].view_as(v)


def expert_names(moe: MoEConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of one expert's gate, up and down weights."""
    if moe.naming == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_name(moe: MoEConfig, layer: int) -> str:
    block = "block_sparse_moe" if moe.naming == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def shared_expert_names(layer: int) -> tuple[str, str, str, str]:
    """Qwen2-MoE's shared expert: gate, up, down, and its sigmoid gate's weight."""
    p = f"model.layers.{layer}.mlp."
    e = p + "shared_expert."
    return (
        e + "gate_proj.weight",
        e + "up_proj.weight",
        e + "down_proj.weight",
        p + "shared_expert_gate.weight",
    )


def moe_linear_sources(block: SparseMoE, layer: int) -> list[tuple[Linear, list[str]]]:
    """Each expert Linear with the HF names fused into it (gate and up into gate_up)."""
    out: list[tuple[Linear, list[str]]] = []
    for e, expert in zip(block.held, block.experts):
        gate, up, down = expert_names(block.moe, layer, e)
        out += [(expert.gate_up_proj, [gate, up]), (expert.down_proj, [down])]
    if block.shared_expert is not None:
        gate, up, down, _ = shared_expert_names(layer)
        out += [(block.shared_expert.gate_up_proj, [gate, up]), (block.shared_expert.down_proj, [down])]
    return out


def load_moe_extras(block: SparseMoE, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    """The router and the shared expert's gate (the experts' Linears load with the others)."""
    block.router.copy_(tensors[router_name(block.moe, layer)])
    if block.shared_expert_gate is not None:
        block.shared_expert_gate.copy_(tensors[shared_expert_names(layer)[3]])


def moe_layer_names(moe: MoEConfig, layer: int) -> list[str]:
    """Every HF weight name a sparse layer's MLP needs: what a loader checks is present."""
    names = [router_name(moe, layer)]
    for e in range(moe.num_experts):
        names += expert_names(moe, layer, e)
    if moe.shared_expert_intermediate_size:
        names += shared_expert_names(layer)
    return names
