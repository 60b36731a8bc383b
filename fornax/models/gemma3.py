"""Gemma 3 (text): the Llama family's layers with Gemma's differences.

A second module rather than more switches in models/llama.py, because the decoder layer
itself differs, not a detail inside it: four norms per layer (before and after attention,
before and after the MLP) in place of two, so the residual adds cannot be fused with the
norm that follows, as the Llama layer does. What is the same is shared: the fused QKV and
gate/up projections (layers/linear.py, so every weight form and kernel applies), the paged
attention, the KV cache, and the way weights load.

The differences, as in HF transformers' Gemma3ForCausalLM:
- RMSNorm scales by (1 + weight) and multiplies in float32 before rounding (GemmaRMSNorm);
- Q and K are RMS-normalised per head before RoPE, and scores are scaled by
  query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- layers interleave sliding-window attention (RoPE base rope_local_theta) with full
  attention (RoPE base rope_theta and any scaling): five local layers to one global in the
  released models (config.layer_types);
- the MLP is GeGLU: gelu_tanh(gate) * up;
- embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype;
- the LM head is tied to the embedding table; logits may be soft-capped (none in Gemma 3).
"""

from __future__ import annotations

import torch
from torch import nn

from fornax.config import ModelConfig
from fornax.layers.attention import AttentionMetadata
from fornax.layers.kv_pool import LayerKV
from fornax.layers.linear import Linear
from fornax.layers.ops import TORCH_OPS, LayerOps
from fornax.layers.rotary import RotaryEmbedding
from fornax.models.base import KVCache
from fornax.models.llama import MLP, Attention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, rounded once at the end. The
    weight is held as (1 + w) in float32, computed from w in the model's dtype: the factor
    HF's Gemma3RMSNorm forms on every call."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps
        self.ops: LayerOps = TORCH_OPS  # set by Gemma3ForCausalLM.use_ops

    def set_from_hf(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight.copy_(1.0 + w.to(dtype).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_f32_weight(x, self.weight, self.eps)


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, sliding: bool) -> None:
        super().__init__(config, dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding = sliding


class Gemma3MLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_mul(self.gate_up_proj(x)))  # gate_up: [T, 2I]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, sliding: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, dtype, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def norms(self) -> dict[str, GemmaRMSNorm]:
        return {n: getattr(self, n) for n in NORM_NAMES}

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: the residual stream [T, hidden] -> the stream after this layer."""
        a = self.self_attn(self.input_layernorm(x), cos_sin, kv, meta)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(m)


NORM_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """What the engine sees is LlamaForCausalLM's interface (forward, compute_logits,
    linear_sources, the weight-form queries); only the layers and the loading differ."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config, self.dtype = config, dtype
        table = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=table, _freeze=True
        )
        # sqrt(hidden) in the model's dtype, as HF multiplies it (25.25 in bf16 for 640, not 25.298)
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        types = config.layer_types or ("full_attention",) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, dtype, t == "sliding_attention") for t in types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        # computed per step, not tabled: two 32k-position tables of head_dim 256 would hold 128 MiB
        max_pos, d = config.max_position_embeddings, config.head_dim
        self.rotary = RotaryEmbedding(d, max_pos, config.rope_theta, config.rope_scaling, precompute=False)
        local_theta = config.rope_local_theta or config.rope_theta
        self.rotary_local = RotaryEmbedding(d, max_pos, local_theta, None, precompute=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        full = self.rotary.cos_sin(positions, x.dtype)
        local = self.rotary_local.cos_sin(positions, x.dtype)
        # all layers sliding (no interleaving): `meta` itself carries the window
        windowed = meta.sliding if meta.sliding is not None else meta
        for i, layer in enumerate(self.layers):
            sliding = layer.self_attn.sliding
            x = layer(x, local if sliding else full, kv_cache.layers[i], windowed if sliding else meta)
        return self.norm(x)

    def use_ops(self, ops: LayerOps) -> None:
        super().use_ops(ops)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """HF-named tensors (norm weights as HF holds them: w, applied as 1 + w)."""
        self.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        self.norm.set_from_hf(tensors["model.norm.weight"], self.dtype)
        sources = self.linear_sources()
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            sources = sources[1:]
        for linear, names in sources:
            torch.cat([tensors[n] for n in names], dim=0, out=linear.weight)  # one pass, no temporary
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name, norm in layer.norms().items():
                norm.set_from_hf(tensors[p + name + ".weight"], self.dtype)
            layer.self_attn.q_norm.set_from_hf(tensors[p + "self_attn.q_norm.weight"], self.dtype)
            layer.self_attn.k_norm.set_from_hf(tensors[p + "self_attn.k_norm.weight"], self.dtype)
