"""What single families' GGUF files say, or leave to llama.cpp's code: Gemma 3's layer pattern
and RoPE bases, Phi-3's LongRoPE tables and sliding window (models/loader.py reads the rest)."""

from __future__ import annotations

from typing import Any

from fornax.models.gguf_meta import MAX_CONTEXT_LENGTH, meta_float, meta_int

# What GGUF files do not say about Gemma 3 and llama.cpp fixes in code: every sixth layer
# attends globally, the others within the window, with RoPE base 10,000 on those.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def longrope_scaling(metadata: dict[str, Any], short: list[float], long: list[float]) -> dict[str, Any]:
    """Phi-3's LongRoPE from llama.cpp's converter: the factor tables, the trained context, and
    the cos/sin factor it wrote (transformers' default where absent)."""
    original = meta_int(metadata, "phi3.rope.scaling.original_context_length", MAX_CONTEXT_LENGTH)
    context = meta_int(metadata, "phi3.context_length", MAX_CONTEXT_LENGTH)
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long}
    scaling |= {"original_max_position_embeddings": original, "factor": context / original}
    if "phi3.rope.scaling.attn_factor" in metadata:
        scaling["attention_factor"] = meta_float(metadata, "phi3.rope.scaling.attn_factor")
    return scaling


def gemma3_gguf_config(
    metadata: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    window = meta_int(metadata, "gemma3.attention.sliding_window", MAX_CONTEXT_LENGTH)
    sliding = [(i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(layers)]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding),
        "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
        # HF's query_pre_attn_scalar: head_dim, except in the 27B model (62 layers), which
        # scales by hidden / heads (168 there); llama.cpp decides it the same way.
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
    }


def phi3_gguf_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's fused projections, and its window (0 in Phi-4's files: none)."""
    window = None
    if metadata.get("phi3.attention.sliding_window"):
        window = meta_int(metadata, "phi3.attention.sliding_window", MAX_CONTEXT_LENGTH)
    return {"fused_projections": True, "sliding_window": window}
