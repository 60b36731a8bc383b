"""Weights and config from a Hugging Face directory (config.json and safetensors shards), in
the same HF names and layouts the GGUF loader (models/loader.py) gives; a BERT encoder's config
(models/bert.py) and the directory's pooling (models/pooling_config.py) with them."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fornax.config import ConfigError, ModelConfig, MoEConfig
from fornax.models.bert import ENCODER_ARCHITECTURES, bert_model_config
from fornax.models.gguf_families import GEMMA3_LOCAL_ROPE_THETA, GEMMA3_SLIDING_PATTERN
from fornax.models.loader import (
    CutsFor,
    LoadedWeights,
    ModelLoadError,
    check_tensor_set,
)
from fornax.models.pooling_config import read_pooling_config
from fornax.models.sharding import take_cut

GATED_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
SUPPORTED_HF_ARCHITECTURES = {
    f"{family}ForCausalLM"
    for family in (
        "Llama",
        "Mistral",
        "Qwen2",
        "Qwen3",
        "Gemma3",
        "Mixtral",
        "Qwen2Moe",
        "Qwen3Moe",
        "Olmoe",
        "Phi3",
    )
}


def hf_model_config(hf_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((hf_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {hf_dir / 'config.json'}: {exc}") from None
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    pooling = read_pooling_config(hf_dir, raw)  # how it embeds (models/pooling_config.py)
    if arch in ENCODER_ARCHITECTURES:
        try:
            return bert_model_config(raw, hf_dir.name, pooling)
        except (KeyError, ValueError, ConfigError) as exc:
            raise ModelLoadError(f"bad config.json in {hf_dir}: {exc}") from None
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_HF_ARCHITECTURES | ENCODER_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {supported})")
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in GATED_ACTIVATIONS:  # the decoders' MLPs are gated: SwiGLU or GeGLU
        raise ModelLoadError(f"unsupported activation {act!r} (supported: {', '.join(GATED_ACTIVATIONS)})")
    gemma = arch == "Gemma3ForCausalLM"
    # transformers 5 nests RoPE settings in `rope_parameters` (Gemma 3: one dict per layer
    # type); older files use flat keys.
    rope_parameters = raw.get("rope_parameters") or {}
    local_rope = None
    if gemma and "full_attention" in rope_parameters:
        local_rope = rope_parameters.get("sliding_attention") or {}
        rope_parameters = rope_parameters["full_attention"] or {}
    rope = dict(rope_parameters or raw.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # early Phi-3 files' name for it
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}")
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor < 1) are not supported yet")
    if rope_type == "longrope":  # transformers' defaults: the trained context, and the ratio to it
        original = int(
            rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
        )
        rope["original_max_position_embeddings"] = original
        rope.setdefault("factor", int(raw["max_position_embeddings"]) / original)
        rope.pop("partial_rotary_factor", None)
    if rope_type == "yarn":  # transformers takes the trained context from the config when absent
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    heads = int(raw["num_attention_heads"])
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma ties unless told
            attention_bias=arch == "Qwen2ForCausalLM"
            or bool(raw.get("attention_bias", False))
            or (arch == "Qwen2MoeForCausalLM" and bool(raw.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            qk_norm_whole=arch == "OlmoeForCausalLM",
            fused_projections=arch == "Phi3ForCausalLM",
            clip_qkv=float(raw["clip_qkv"]) if arch == "OlmoeForCausalLM" and raw.get("clip_qkv") else None,
            hidden_act=act,
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            name=hf_dir.name,
            pooling=pooling,
            moe=_moe_hf_config(arch, raw),
            **(_gemma3_hf_config(raw, local_rope) if gemma else {}),
        )
    except (KeyError, ValueError, TypeError, ConfigError) as exc:
        raise ModelLoadError(f"bad config.json in {hf_dir}: {exc}") from None


def _moe_hf_config(arch: str, raw: dict[str, Any]) -> MoEConfig | None:
    """The experts of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE configs, with transformers' defaults."""
    layers = int(raw["num_hidden_layers"])
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size, renormalized
        return MoEConfig(
            num_experts=int(raw.get("num_local_experts", 8)),
            top_k=int(raw.get("num_experts_per_tok", 2)),
            expert_intermediate_size=int(raw["intermediate_size"]),
            normalize_top_k=True,
            sparse_layers=tuple(range(layers)),
            naming="mixtral",
        )
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        return None
    # hub files say num_experts; transformers 5 writes num_local_experts (an attribute map)
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(
        num_experts=experts,
        top_k=int(raw.get("num_experts_per_tok", 2)),
        # OLMoE's experts are intermediate_size wide (it has no dense MLP)
        expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        normalize_top_k=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=shared,
    )


def _gemma3_hf_config(raw: dict[str, Any], local_rope: dict[str, Any] | None) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    pattern = int(
        raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or GEMMA3_SLIDING_PATTERN
    )
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    local_theta = (
        (local_rope or {}).get("rope_theta") or raw.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA
    )
    return {
        "layer_types": tuple(types),
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
    }


def load_hf_dir(
    hf_dir: Path, dtype: torch.dtype, progress: bool = True, cuts_for: CutsFor | None = None
) -> LoadedWeights:
    """cuts_for: as load_gguf's; safetensors reads only those parts from its memory map."""
    from safetensors import SafetensorError, safe_open

    config = hf_model_config(hf_dir)
    cuts = cuts_for(config) if cuts_for is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(hf_dir.glob("*.safetensors"))
    for shard in tqdm(
        shards, desc=f"loading {hf_dir.name}", unit="shard", disable=not progress, file=sys.stderr
    ):
        try:
            with safe_open(str(shard), framework="pt") as file:
                for name in file.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    cut = cuts.get(name)
                    tensor = file.get_tensor(name) if cut is None else take_cut(file.get_slice(name), cut)
                    tensors[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {shard}: {exc}") from None
    if config.encoder:  # no LM head; BertModel.load_weights checks its own tensors
        return LoadedWeights(config=config, tensors=tensors, metadata={})
    if "lm_head.weight" not in tensors and not config.tie_word_embeddings:
        config = replace(config, tie_word_embeddings=True)
    check_tensor_set(config, tensors)
    return LoadedWeights(config=config, tensors=tensors, metadata={})
