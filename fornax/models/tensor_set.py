"""The HF-named tensors a decoder's checkpoint must hold, by its config: what both loaders
check before building (models/loader.py, models/hf_dir.py; docs/architecture.md)."""

from __future__ import annotations

from fornax.config import ModelConfig
from fornax.models.moe import moe_layer_names

# The weights every decoder layer has (biases and q/k norms are per family).
_ATTENTION = ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Phi-3 stores Q/K/V and gate/up fused (ModelConfig.fused_projections)
_FUSED_QKV, _FUSED_MLP = ("self_attn.qkv_proj",), ("mlp.gate_up_proj", "mlp.down_proj")


def required_tensor_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    fused = config.fused_projections
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}{n}.weight" for n in _ATTENTION + (_FUSED_QKV if fused else _QKV)]
        if config.moe is not None and i in config.moe.sparse_layers:
            names += moe_layer_names(config.moe, i)
        else:
            names += [f"{p}{n}.weight" for n in (_FUSED_MLP if fused else _DENSE_MLP)]
    return names
