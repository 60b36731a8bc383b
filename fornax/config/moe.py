"""A mixture-of-experts MLP's shape and routing (models/moe.py; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fornax.config.common import ConfigError

# How a family names its expert tensors in Hugging Face checkpoints: Qwen2-MoE and Qwen3-MoE
# (`mlp.experts.E.gate_proj`, router `mlp.gate`) or Mixtral (`block_sparse_moe.experts.E.w1`,
# w3 the up and w2 the down projection, router `block_sparse_moe.gate`).
MOE_NAMINGS = ("qwen", "mixtral")

# Bound on experts per layer, checked before anything is sized from a config: several times
# the largest open models' (DeepSeek-V3 and Qwen3-235B-A22B use 256 and 128).
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class MoEConfig:
    """Each sparse layer's MLP is `num_experts` gated MLPs of `expert_intermediate_size`; a
    router picks `top_k` of them per token by softmax over its logits (top-k of the softmax, as
    Mixtral, Qwen-MoE and OLMoE all route), their weights renormalized to sum to 1 when
    `normalize_top_k`. Qwen2-MoE adds one always-on shared expert behind a sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[int, ...]  # the layers with experts; the others keep a dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    naming: str = "qwen"
    # A tensor-parallel rank's share (models/sharding.py): the experts [start, stop) it holds;
    # None: all of them. The router always sees every expert.
    local_experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.num_experts <= MAX_EXPERTS:
            raise ConfigError(f"num_experts must be in 1..{MAX_EXPERTS}, got {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.top_k}")
        if self.expert_intermediate_size <= 0 or self.shared_expert_intermediate_size < 0:
            raise ConfigError("expert sizes must be positive")
        if (
            self.local_experts is not None
            and not 0 <= self.local_experts[0] <= self.local_experts[1] <= self.num_experts
        ):
            raise ConfigError(f"local experts {self.local_experts} outside 0..{self.num_experts}")
        if self.naming not in MOE_NAMINGS:
            raise ConfigError(f"unknown expert naming {self.naming!r}")

    @property
    def held_experts(self) -> range:
        """The experts this process holds (all, outside tensor parallelism)."""
        return range(*(self.local_experts or (0, self.num_experts)))
