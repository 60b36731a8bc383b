"""The Llama family decoder: Llama 2/3, Mistral, SmolLM2, and the Qwen2/Qwen3 variants.

These architectures differ only in small switches that the config carries: QKV bias
(Qwen2), per-head RMSNorm on Q and K before RoPE (Qwen3), RoPE scaling (Llama 3),
sliding-window attention (Mistral), Q/K/V and gate/up stored fused (Phi-3, with LongRoPE),
tied embeddings, and mixture-of-experts MLPs in some or all layers (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE with its whole-projection Q/K norms: models/moe.py). One implementation keeps them
exactly in step with each other; `models/__init__.py` maps HF architecture names here.

The forward pass takes a flattened batch: tokens of many sequences laid end to end,
with their positions and the paged-attention metadata built once per step.
"""

from __future__ import annotations

import torch
from torch import nn

from fornax.config import ModelConfig
from fornax.layers.attention import AttentionMetadata, paged_attention
from fornax.layers.kv_pool import LayerKV
from fornax.layers.linear import Linear
from fornax.layers.norm import RMSNorm
from fornax.layers.ops import TORCH_OPS, LayerOps
from fornax.layers.rotary import RotaryEmbedding
from fornax.models.base import KVCache, LinearForms
from fornax.models.moe import GatedMLP, SparseMoE, load_moe_extras, moe_linear_sources


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype)
        self.whole_qk_norm, self.clip = config.qk_norm_whole, config.clip_qkv
        q_width, k_width = (
            (self.q_size, self.kv_size) if self.whole_qk_norm else (self.head_dim, self.head_dim)
        )
        norms = config.qk_norm or self.whole_qk_norm
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype) if norms else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype) if norms else None
        self.scale = self.head_dim**-0.5
        self.ops: LayerOps = TORCH_OPS  # set by LlamaForCausalLM.use_ops

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, q + 2 kv], a fresh tensor (rotary may work in place)
        cos, sin = cos_sin
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(t, hkv, d)  # [T, Hkv, D]
        if self.whole_qk_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # OLMoE: over each whole projection, [T, q] / [T, kv]
            if self.clip is not None:
                q, k, v = (x.clamp(-self.clip, self.clip) for x in (q, k, v))
            q = self.ops.rotary_(q.contiguous(), h, cos, sin)  # [T, H, D]
            k = self.ops.rotary_(k.contiguous(), hkv, cos, sin)  # [T, Hkv, D]
        elif self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norms before RoPE
            q = self.ops.rotary_(self.q_norm(q.view(t, h, d)).view(t, -1), h, cos, sin)  # [T, H, D]
            k = self.ops.rotary_(self.k_norm(k.view(t, hkv, d)).view(t, -1), hkv, cos, sin)  # [T, Hkv, D]
        else:  # Q and K heads are adjacent in each row: one call rotates both
            qk = self.ops.rotary_(qkv, h + hkv, cos, sin)  # [T, H + Hkv, D]
            q, k = qk[:, :h], qk[:, h:]
        out = paged_attention(q, k, v, kv, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)
        self.ops: LayerOps = TORCH_OPS  # set by LlamaForCausalLM.use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))  # gate_up: [T, 2I]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        moe = config.moe
        self.mlp: nn.Module = (
            SparseMoE(config, moe, dtype)
            if moe is not None and index in moe.sparse_layers
            else MLP(config, dtype)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (its MLP's), residual: the stream before it (None at the
        first layer). Returns the same pair for the next layer, so that each residual add is
        fused with the norm that follows it: residual + x is exactly the old `h = x + ...`."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn(h, cos_sin, kv, meta)
        h, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(LinearForms):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        # Given its (empty) weight, nn.Embedding skips its random init: time spent on a table
        # that loading overwrites.
        table = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=table, _freeze=True
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype, meta.seq_lens)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos_sin, kv_cache.layers[i], meta)
        return self.norm.add_forward(x, residual)[0]

    def linear_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each Linear with the HF weight names fused into it, in order (rows concatenated):
        what load_weights copies, and what quantization="auto" looks up in the file."""
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        out: list[tuple[Linear, list[str]]] = [(self.lm_head, [head])]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            fused = self.config.fused_projections  # Phi-3 stores Q/K/V and gate/up fused already
            qkv = (
                [p + "self_attn.qkv_proj.weight"]
                if fused
                else [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            )
            out.append((attn.qkv_proj, qkv))
            out.append((attn.o_proj, [p + "self_attn.o_proj.weight"]))
            if isinstance(mlp, SparseMoE):
                out += moe_linear_sources(mlp, i)
                continue
            gate_up = (
                [p + "mlp.gate_up_proj.weight"]
                if fused
                else [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            )
            out.append((mlp.gate_up_proj, gate_up))
            out.append((mlp.down_proj, [p + "mlp.down_proj.weight"]))
        return out

    def use_ops(self, ops: LayerOps) -> None:
        """Run norms, rotary and SiLU*up through `ops` (layers/ops.py: torch or native)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, GatedMLP)):
                module.ops = ops
            elif isinstance(module, SparseMoE):
                module.use_ops(ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], only for the rows that are sampled."""
        return self.lm_head(hidden).float()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive (linear_sources)."""
        self.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        self.norm.weight.copy_(tensors["model.norm.weight"])
        sources = self.linear_sources()
        if self.config.tie_word_embeddings:  # one table for both ends, not two copies of it
            self.lm_head.weight = self.embed_tokens.weight
            sources = sources[1:]  # linear_sources() lists the head first
        for linear, names in sources:
            torch.cat([tensors[n] for n in names], dim=0, out=linear.weight)  # one pass, no temporary
            if linear.bias is not None:  # Qwen2's QKV bias
                linear.bias.copy_(torch.cat([tensors[n.removesuffix("weight") + "bias"] for n in names]))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(tensors[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(tensors[p + "post_attention_layernorm.weight"])
            if isinstance(layer.mlp, SparseMoE):
                load_moe_extras(layer.mlp, i, tensors)
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.copy_(tensors[p + "self_attn.q_norm.weight"])
                attn.k_norm.weight.copy_(tensors[p + "self_attn.k_norm.weight"])
