"""Weights and config from GGUF or safetensors, in Hugging Face tensor names.

Everything below the loader speaks HF names and HF layouts, so one model implementation
serves both sources. GGUF tensors are dequantized with the `gguf` package's own numpy
kernels; llama.cpp's Q/K row permutation (done by its converter for Llama-family models,
to suit its interleaved RoPE) is undone here so the weights are in HF's half-split layout.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fornax.config import ConfigError, ModelConfig
from fornax.models.gguf_file import GGUFFile, GGUFFormatError

# GGUF architecture name -> (HF architecture, permuted Q/K, QKV bias, per-head Q/K norm)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool, bool, bool]] = {
    "llama": ("LlamaForCausalLM", True, False, False),
    "mistral": ("MistralForCausalLM", True, False, False),
    "qwen2": ("Qwen2ForCausalLM", False, True, False),
    "qwen3": ("Qwen3ForCausalLM", False, False, True),
}
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
}  # fmt: skip
# Quant types we accept; the gguf package dequantizes each of these.
SUPPORTED_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelLoadError(Exception):
    """A model file that cannot be used; the message is one clear line."""


@dataclass
class Int4Blocks:
    """A GGUF Q4_0 / Q4_1 tensor's own quantization, unpacked: w = (q - 8) * scale + zero per
    block of 32 input values (Q4_1 stores w = q * d + m: scale = d, zero = m + 8 d; Q4_0
    stores w = (q - 8) * d: zero = 0). That is the form torch's int4 CPU kernel computes."""

    q: torch.Tensor  # [out, in] uint8 in [0, 15]
    scale: torch.Tensor  # [out, in / 32] float32
    zero: torch.Tensor  # [out, in / 32] float32
    group_size: int = 32


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names -> tensors in the requested dtype
    metadata: dict[str, Any]  # GGUF key/values (tokenizer, chat template); {} for HF dirs
    # GGUF only: the small-step form that keeps each quantized tensor's precision, by HF name
    # (_FILE_QUANTIZATION), so `quantization="auto"` can use what the file carries.
    file_quantization: dict[str, str] = field(default_factory=dict)
    int4_blocks: dict[str, Int4Blocks] = field(default_factory=dict)  # only when asked for


def read_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file; any malformation becomes one ModelLoadError line."""
    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None


def gguf_model_config(metadata: dict[str, Any], name: str = "model") -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {supported})")
    hf_arch, _, has_bias, qk_norm = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
    rope_scaling = None
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported RoPE scaling {scaling_type!r} in GGUF")
    try:
        return ModelConfig(
            architecture=hf_arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided from the tensors present
            attention_bias=has_bias,
            qk_norm=qk_norm,
            name=name,
        )
    except ConfigError as exc:
        raise ModelLoadError(f"bad GGUF model config: {exc}") from None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None


# The small-step form that keeps a GGUF tensor's precision: 4-bit types -> int4, 5- to 8-bit
# types -> int8. Q4_0/Q4_1 map onto torch's int4 layout block for block (Int4Blocks).
_FILE_QUANTIZATION = {
    "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
    "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8", "Q8_0": "int8",
}  # fmt: skip


def _q4_blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of packed Q4_0 / Q4_1 blocks -> (q [rows, cols] uint8, scale, zero [rows, cols / 32]).

    A block is an f16 scale d (Q4_1: then an f16 minimum m) and 16 bytes holding 32 4-bit
    values: the low nibbles are elements 0-15, the high nibbles elements 16-31 (ggml's layout)."""
    header = 4 if type_name == "Q4_1" else 2
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)
    packed = blocks[..., header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        return q, d, m + 8.0 * d
    return q, d, np.zeros_like(d)


def load_gguf(path: Path, dtype: torch.dtype, progress: bool = True, keep_int4_blocks: bool = False) -> LoadedWeights:
    from gguf.quants import dequantize

    gguf_file = read_gguf(path)
    if gguf_file.byte_order != "<":  # the dequantizers read block scales as little-endian
        raise ModelLoadError(f"{path} is a big-endian GGUF; only little-endian files can be loaded")
    metadata = gguf_file.metadata
    for t in gguf_file.tensors:  # refuse before any work, whatever else the file holds
        if t.type_name not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"tensor {t.name} has unsupported GGUF quant type {t.type_name}")
    config = gguf_model_config(metadata, name=path.stem)
    arch = metadata["general.architecture"]
    permuted = GGUF_ARCHITECTURES[arch][1]
    tensors: dict[str, torch.Tensor] = {}
    file_quantization: dict[str, str] = {}
    int4_blocks: dict[str, Int4Blocks] = {}
    freq_factors: torch.Tensor | None = None
    bar = tqdm(gguf_file.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress, file=sys.stderr)
    for t in bar:
        array = dequantize(t.data, t.qtype)  # numpy, HF (row-major) shape
        if t.name == "rope_freqs.weight":
            freq_factors = torch.tensor(np.asarray(array, dtype=np.float32))
            continue
        hf_name = _gguf_to_hf_name(t.name)
        if hf_name is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in a {arch} GGUF")
        heads = None
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        if heads is not None:
            array = _unpermute_rows(array, heads)
        if t.type_name in _FILE_QUANTIZATION:
            file_quantization[hf_name] = _FILE_QUANTIZATION[t.type_name]
        if keep_int4_blocks and t.type_name in ("Q4_0", "Q4_1") and len(t.shape) == 2:
            parts = _q4_blocks(t.data, t.type_name)
            if heads is not None:  # the same row order as the dequantized weight
                parts = tuple(_unpermute_rows(x, heads) for x in parts)
            q, scale, zero = (torch.from_numpy(np.ascontiguousarray(x)) for x in parts)
            int4_blocks[hf_name] = Int4Blocks(q=q, scale=scale, zero=zero)
        if not array.flags.writeable:  # F32/F16 tensors are read-only views of the file map
            array = array.copy()
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype)
    tied = "lm_head.weight" not in tensors
    scaling = config.rope_scaling
    if freq_factors is not None:  # Llama 3.x: llama.cpp stores the per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": freq_factors.tolist()}
    config = _replace(config, tie_word_embeddings=tied, rope_scaling=scaling)
    _check_tensor_set(config, tensors)
    return LoadedWeights(config, tensors, metadata, file_quantization, int4_blocks)


def _replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(config, **changes)


def hf_model_config(hf_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((hf_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {hf_dir / 'config.json'}: {exc}") from None
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_HF_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {supported})")
    # transformers 5 nests RoPE settings in `rope_parameters`; older files use flat keys.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}")
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
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=raw.get("hidden_act", "silu"),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            name=hf_dir.name,
        )
    except (KeyError, ConfigError) as exc:
        raise ModelLoadError(f"bad config.json in {hf_dir}: {exc}") from None


def load_hf_dir(hf_dir: Path, dtype: torch.dtype, progress: bool = True) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = hf_model_config(hf_dir)
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(hf_dir.glob("*.safetensors"))
    for shard in tqdm(shards, desc=f"loading {hf_dir.name}", unit="shard", disable=not progress, file=sys.stderr):
        try:
            for name, tensor in load_file(str(shard)).items():
                tensors[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {shard}: {exc}") from None
    if "lm_head.weight" not in tensors and not config.tie_word_embeddings:
        config = _replace(config, tie_word_embeddings=True)
    _check_tensor_set(config, tensors)
    return LoadedWeights(config=config, tensors=tensors, metadata={})


def _check_tensor_set(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        required += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]  # fmt: skip
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ModelLoadError(f"model is missing {len(missing)} tensors, e.g. {missing[0]}")
    embed = tensors["model.embed_tokens.weight"]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"embedding shape {tuple(embed.shape)} does not match vocab {config.vocab_size} x hidden "
            f"{config.hidden_size}"
        )
