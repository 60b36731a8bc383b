"""A model's architecture, in Hugging Face's vocabulary: what the loaders read from a GGUF
header or a config.json and every layer is sized from (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fornax.config.common import ConfigError
from fornax.config.moe import MoEConfig
from fornax.config.pooling import PoolingConfig


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face's vocabulary."""

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    # OLMoE: RMSNorm over the whole Q and K projections (before the split into heads), and
    # optionally every Q, K and V value clamped to [-clip_qkv, clip_qkv] after it.
    qk_norm_whole: bool = False
    # Phi-3: the checkpoint holds Q/K/V as one qkv_proj and gate/up as one gate_up_proj tensor
    fused_projections: bool = False
    clip_qkv: float | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None
    name: str = "model"
    # Gemma 3 (models/gemma3.py): which layers attend within the sliding window
    # ("sliding_attention") and which see the whole context ("full_attention"); None: every
    # layer alike (the window, if any, applies to all). The sliding layers' own RoPE base,
    # the attention scale's divisor, and a tanh cap on the final logits.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # A bidirectional encoder without an LM head (BERT, models/bert.py): it serves pooling
    # requests only, computes each prompt whole in one step (its attention sees the whole
    # sequence), and keeps no K/V. type_vocab_size: BERT's token-type (segment) embeddings.
    encoder: bool = False
    type_vocab_size: int = 0
    pooling: PoolingConfig = field(default_factory=PoolingConfig)  # how it embeds (config/pooling.py)
    # Mixture-of-experts MLPs (config/moe.py, models/moe.py); None: every layer's MLP is dense.
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.moe is not None and any(not 0 <= i < self.num_hidden_layers for i in self.moe.sparse_layers):
            raise ConfigError("a sparse layer index is past num_hidden_layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError("layer_types must name one attention type per layer")
            if not set(self.layer_types) <= {"sliding_attention", "full_attention"}:
                raise ConfigError(f"unsupported layer types {sorted(set(self.layer_types))}")

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence it serves: its position table, or less for an embedder trained
        on shorter inputs (PoolingConfig.max_seq_length)."""
        return min(self.max_position_embeddings, self.pooling.max_seq_length or self.max_position_embeddings)

    @property
    def interleaves_sliding_window(self) -> bool:
        """Whether some layers attend within the window and others over the whole context."""
        return (
            self.sliding_window is not None
            and self.layer_types is not None
            and len(set(self.layer_types)) > 1
        )


# The gated MLP's activation: SwiGLU (Llama family) or GeGLU with tanh-approximated GELU (Gemma);
# BERT's plain (not gated) MLP: exact GELU.
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")
