"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (Mixtral as `llama` with
experts, `qwen2moe`, `qwen3moe`, `olmoe`): the routing from the metadata, and the names and shapes of
the expert tensors in HF's per-expert vocabulary (models/moe.py; docs/models.md).

llama.cpp merges each layer's experts into one 3-D tensor per projection (`ffn_gate_exps`:
[experts, expert width, hidden] in numpy order), so the loader splits it along its first axis
into one HF tensor per expert; a quantized tensor's rows of blocks split the same way, so each
expert keeps the file's blocks (`quantization="auto"`) exactly as a dense projection would.
"""

from __future__ import annotations

import re
from typing import Any

from fornax.config import MAX_EXPERTS, ConfigError, MoEConfig
from fornax.models.gguf_meta import MAX_FEED_FORWARD_LENGTH, ModelLoadError, meta_int

# What llama.cpp's graph does with the top-k weights, per architecture: renormalized for
# Mixtral and Qwen3-MoE, not for Qwen2-MoE and OLMoE (its build_moe_ffn calls). The files do
# not say.
GGUF_MOE_NORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}

# one tensor per layer -> its HF name after "model.layers.N."
GGUF_MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# merged experts -> each expert's HF name after "model.layers.N.mlp.experts.E."
GGUF_MERGED_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj.weight",
    "ffn_up_exps.weight": "up_proj.weight",
    "ffn_down_exps.weight": "down_proj.weight",
}
_MERGED = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps\.weight)")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")


def router_layers(tensor_names: list[str], layers: int) -> tuple[int, ...]:
    """The layers below `layers` that have a router (`blk.N.ffn_gate_inp`): the sparse ones.
    A router past the last layer is left to the shape check, which names the tensor."""
    found = {int(m.group(1)) for m in map(_ROUTER.fullmatch, tensor_names) if m}
    return tuple(sorted(i for i in found if i < layers))


def gguf_moe_config(metadata: dict[str, Any], arch: str, layers: int) -> MoEConfig | None:
    """The routing a MoE GGUF declares (`{arch}.expert_count` and friends); None for a dense file."""
    p = f"{arch}."
    if arch not in GGUF_MOE_NORMALIZES or not metadata.get(p + "expert_count"):
        return None
    experts = meta_int(metadata, p + "expert_count", MAX_EXPERTS)
    # Mixtral's and OLMoE's experts are the feed-forward width (neither has a dense MLP)
    width_key = p + ("feed_forward_length" if arch in ("llama", "olmoe") else "expert_feed_forward_length")
    shared = 0
    if arch == "qwen2moe" and metadata.get(p + "expert_shared_feed_forward_length"):
        shared = meta_int(metadata, p + "expert_shared_feed_forward_length", MAX_FEED_FORWARD_LENGTH)
    try:
        return MoEConfig(
            num_experts=experts,
            top_k=meta_int(metadata, p + "expert_used_count", MAX_EXPERTS),
            expert_intermediate_size=meta_int(metadata, width_key, MAX_FEED_FORWARD_LENGTH),
            normalize_top_k=GGUF_MOE_NORMALIZES[arch],
            sparse_layers=tuple(range(layers)),  # the loader narrows it to the layers with a router
            shared_expert_intermediate_size=shared,
        )
    except ConfigError as exc:
        raise ModelLoadError(f"bad expert metadata: {exc}") from None


def merged_experts(name: str) -> tuple[int, str] | None:
    """(layer, HF suffix per expert) for a merged expert tensor's GGUF name, else None."""
    m = _MERGED.fullmatch(name)
    return (int(m.group(1)), GGUF_MERGED_EXPERTS[m.group(2)]) if m else None


def expert_hf_name(layer: int, expert: int, suffix: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{suffix}"


def moe_expected_shape(moe: MoEConfig, hidden: int, part: str) -> tuple[int, ...] | None:
    """The numpy-order shape of a MoE tensor by its HF name after "model.layers.N." (merged
    experts by their GGUF suffix), or None for a name that is not one."""
    e, width, shared = moe.num_experts, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
    shapes = {
        "mlp.gate.weight": (e, hidden),
        "mlp.shared_expert_gate.weight": (hidden,),  # llama.cpp keeps it 1-D
        "mlp.shared_expert.gate_proj.weight": (shared, hidden),
        "mlp.shared_expert.up_proj.weight": (shared, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, shared),
        "ffn_gate_exps.weight": (e, width, hidden),
        "ffn_up_exps.weight": (e, width, hidden),
        "ffn_down_exps.weight": (e, hidden, width),
    }
    return shapes.get(part)
