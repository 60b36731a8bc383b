"""Weights and config from GGUF (here) or safetensors (models/hf_dir.py), in Hugging Face tensor names.

Everything below the loader speaks HF names and HF layouts, so one model implementation
serves both sources. GGUF tensors are dequantized with the `gguf` package's own numpy
kernels; llama.cpp's Q/K row permutation (done by its converter for Llama-family models,
to suit its interleaved RoPE) is undone here so the weights are in HF's half-split layout.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from tqdm import tqdm

from fornax.config import ConfigError, ModelConfig
from fornax.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor
from fornax.layers.dequantize import dequantize
from fornax.models.gguf_blocks import INT4_BLOCK_TYPES, q4_blocks, q4k_blocks
from fornax.models.gguf_families import (
    gemma3_gguf_config,
    longrope_scaling,
    phi3_gguf_config,
)
from fornax.models.gguf_meta import (
    MAX_BLOCK_COUNT,
    MAX_CONTEXT_LENGTH,
    MAX_EMBEDDING_LENGTH,
    MAX_FEED_FORWARD_LENGTH,
    MAX_HEAD_COUNT,
    MAX_HEAD_DIM,
    MAX_VOCAB_SIZE,
    ModelLoadError,
    meta_float,
    meta_int,
    short_repr,
)
from fornax.models.gguf_moe import (
    GGUF_MOE_LAYER_NAMES,
    expert_hf_name,
    gguf_moe_config,
    merged_experts,
    moe_expected_shape,
    router_layers,
)
from fornax.models.sharding import NOT_HELD, Cut, take_cut
from fornax.models.tensor_set import required_tensor_names

# Given a model's config, the part of each tensor to read (models/sharding.py shard_cuts).
CutsFor = Callable[[ModelConfig], Mapping[str, Cut]]
ArrayOrTensor = TypeVar("ArrayOrTensor", np.ndarray, torch.Tensor)

# GGUF architecture name -> (HF architecture, permuted Q/K, QKV bias, per-head Q/K norm)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool, bool, bool]] = {
    "llama": ("LlamaForCausalLM", True, False, False),
    "mistral": ("MistralForCausalLM", True, False, False),
    "qwen2": ("Qwen2ForCausalLM", False, True, False),
    "qwen3": ("Qwen3ForCausalLM", False, False, True),
    "gemma3": ("Gemma3ForCausalLM", False, False, True),
    "qwen2moe": ("Qwen2MoeForCausalLM", False, True, False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False, False, True),
    "olmoe": ("OlmoeForCausalLM", False, False, False),  # Q/K norms over whole projections
    "phi3": ("Phi3ForCausalLM", False, False, False),  # fused attn_qkv and ffn_up (gate and up)
}
# LongRoPE's factor tables (Phi-3): global tensors, read into the config's rope scaling
_ROPE_TABLES = {
    "rope_freqs.weight": "freqs",
    "rope_factors_long.weight": "long",
    "rope_factors_short.weight": "short",
}
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
# Gemma's GGUF names for its four norms per layer (llama.cpp's converter): ffn_norm is the norm
# before the MLP, as in Llama, but HF calls that pre_feedforward_layernorm there.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_PHI3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up, stacked
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


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
    # GGUF only: the embedding table's tensor in the memory-mapped file, so that its rows can be
    # read from there when nothing needs the table dense (layers/embedding.py).
    embedding_rows: GGUFTensor | None = None


_PARSE_ERRORS = (ValueError, IndexError, KeyError, struct.error, OverflowError, MemoryError, RecursionError)


def read_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file; any malformation becomes one ModelLoadError line."""
    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path} is not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    # The parser checks what it reads; this is the net under it, so that a case it missed
    # still reads as one line about the file rather than a traceback.
    except _PARSE_ERRORS as exc:
        raise ModelLoadError(f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc})") from None


def _gguf_vocab_size(metadata: dict[str, Any], arch: str) -> int:
    key = f"{arch}.vocab_size"
    if key in metadata:
        return meta_int(metadata, key, MAX_VOCAB_SIZE)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"GGUF metadata gives no vocabulary size (no {key}, no tokenizer.ggml.tokens)")
    if len(tokens) > MAX_VOCAB_SIZE:
        raise ModelLoadError(
            f"GGUF vocabulary of {len(tokens)} tokens is out of range (1 to {MAX_VOCAB_SIZE})"
        )
    return len(tokens)


def _head_dim(value: Any) -> int:
    # even: RoPE rotates pairs of values, and the Q/K un-permutation splits each head in two
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_HEAD_DIM or value % 2:
        raise ModelLoadError(
            f"GGUF head dimension {short_repr(value)} is not an even number from 2 to {MAX_HEAD_DIM}"
        )
    return value


def gguf_model_config(metadata: dict[str, Any], name: str = "model") -> ModelConfig:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:  # a list is not even hashable
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(f"unsupported GGUF architecture {short_repr(arch)} (supported: {supported})")
    hf_arch, _, has_bias, qk_norm = GGUF_ARCHITECTURES[arch]
    p = f"{arch}."
    hidden = meta_int(metadata, p + "embedding_length", MAX_EMBEDDING_LENGTH)
    heads = meta_int(metadata, p + "attention.head_count", MAX_HEAD_COUNT)
    kv_heads = meta_int(metadata, p + "attention.head_count_kv", MAX_HEAD_COUNT, default=heads)
    head_dim = _head_dim(metadata.get(p + "attention.key_length") or hidden // heads)
    gemma = arch == "gemma3"
    layers = meta_int(metadata, p + "block_count", MAX_BLOCK_COUNT)
    rope_scaling = None
    scaling_type = metadata.get(p + "rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta_float(metadata, p + "rope.scaling.factor")}
    elif scaling_type == "yarn":  # Qwen2.5/Qwen3 long contexts, as llama.cpp's converter writes them
        original = meta_int(metadata, p + "rope.scaling.original_context_length", MAX_CONTEXT_LENGTH)
        rope_scaling = {"rope_type": "yarn", "factor": meta_float(metadata, p + "rope.scaling.factor")}
        rope_scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):  # llama.cpp's defaults are YaRN's (32, 1) when absent
            if p + f"rope.scaling.yarn_{key}" in metadata:
                rope_scaling[key] = meta_float(metadata, p + f"rope.scaling.yarn_{key}")
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported RoPE scaling {short_repr(scaling_type)} in GGUF")
    moe = gguf_moe_config(metadata, arch, layers)  # None for a dense file
    try:
        return ModelConfig(
            architecture=hf_arch,
            vocab_size=_gguf_vocab_size(metadata, arch),
            hidden_size=hidden,
            intermediate_size=meta_int(metadata, p + "feed_forward_length", MAX_FEED_FORWARD_LENGTH),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=meta_float(metadata, p + "attention.layer_norm_rms_epsilon", positive=False),
            rope_theta=meta_float(metadata, p + "rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=meta_int(metadata, p + "context_length", MAX_CONTEXT_LENGTH, 4096),
            tie_word_embeddings=False,  # decided from the tensors present
            attention_bias=has_bias,
            qk_norm=qk_norm,
            qk_norm_whole=arch == "olmoe",
            clip_qkv=meta_float(metadata, p + "attention.clamp_kqv")
            if p + "attention.clamp_kqv" in metadata
            else None,
            name=name,
            moe=moe,
            **(gemma3_gguf_config(metadata, layers, hidden, heads, head_dim) if gemma else {}),
            **(phi3_gguf_config(metadata) if arch == "phi3" else {}),
        )
    except ConfigError as exc:
        raise ModelLoadError(f"bad GGUF model config: {exc}") from None


def _unpermute_rows(w: ArrayOrTensor, n_heads: int) -> ArrayOrTensor:
    """Inverse of llama.cpp's Q/K permutation: per head, interleaved pairs -> two halves (a
    numpy array or a torch tensor, as given)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = {"gemma3": _GGUF_GEMMA_LAYER_NAMES, "phi3": _GGUF_PHI3_LAYER_NAMES}.get(
        arch, _GGUF_LAYER_NAMES | GGUF_MOE_LAYER_NAMES
    )
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


# The small-step form that keeps a GGUF tensor's precision: 4-bit types -> int4, 5- to 8-bit
# types -> int8. Q4_0/Q4_1/Q4_K map onto the int4 layout block for block (Int4Blocks).
_FILE_QUANTIZATION = dict.fromkeys(("Q4_0", "Q4_1", "Q4_K"), "int4") | dict.fromkeys(
    ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"), "int8"
)


def read_cut(t: GGUFTensor, cut: Cut | None) -> tuple[np.ndarray, Cut | None]:
    """The bytes of `cut` of a file tensor (all of it for None), and the cut still to make after
    dequantizing: a column cut that falls inside the file's blocks (Q4_K/Q6_K hold 256 values)
    reads whole rows, one tensor at a time, and keeps the part."""
    if cut is None:
        return t.data, None
    axis, start, stop = cut
    if axis == 0:
        return t.data[start:stop], None
    if t.data.dtype != np.uint8:  # F32 / F16: typed elements
        return np.ascontiguousarray(t.data[:, start:stop]), None
    per_block, block_bytes = GGML_QUANT_SIZES[t.qtype]
    if start % per_block or stop % per_block:
        return t.data, cut
    return np.ascontiguousarray(
        t.data[:, start // per_block * block_bytes : stop // per_block * block_bytes]
    ), None


def _cut_blocks(parts: tuple[np.ndarray, ...], cut: Cut) -> tuple[np.ndarray, ...]:
    """A column cut of Int4Blocks' (q, scale, zero): whole 32-value blocks only."""
    q, scale, zero = parts
    _, start, stop = cut
    group = q.shape[1] // scale.shape[1]
    if start % group or stop % group:
        raise ModelLoadError(f"a tensor-parallel cut at columns {start}:{stop} splits {group}-value blocks")
    return q[:, start:stop], scale[:, start // group : stop // group], zero[:, start // group : stop // group]


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    progress: bool = True,
    keep_int4_blocks: bool = False,
    cuts_for: CutsFor | None = None,
) -> LoadedWeights:
    """cuts_for: given the model's config, the part of each tensor to read (a tensor-parallel
    rank's, models/sharding.py); the rest of those tensors is not read."""
    gguf_file = read_gguf(path)
    try:
        return _weights_from_gguf(gguf_file, path, dtype, progress, keep_int4_blocks, cuts_for)
    except ModelLoadError as exc:  # the checks speak of the file's contents: say which file
        raise ModelLoadError(f"{path}: {exc}") from None


def _weights_from_gguf(
    gguf_file: GGUFFile,
    path: Path,
    dtype: torch.dtype,
    progress: bool,
    keep_int4_blocks: bool,
    cuts_for: CutsFor | None,
) -> LoadedWeights:
    if gguf_file.byte_order != "<":  # the dequantizers read block scales as little-endian
        raise ModelLoadError("a big-endian GGUF; only little-endian files can be loaded")
    metadata = gguf_file.metadata
    for t in gguf_file.tensors:  # refuse before any work, whatever else the file holds
        if t.type_name not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"tensor {t.name[:64]!r} has unsupported GGUF quant type {t.type_name}")
    config = gguf_model_config(metadata, name=path.stem)
    if config.moe is not None:  # the layers with a router are sparse; any other keeps a dense MLP
        sparse = router_layers([t.name for t in gguf_file.tensors], config.num_hidden_layers)
        config = replace(config, moe=replace(config.moe, sparse_layers=sparse))
    _check_gguf_shapes(config, gguf_file)
    arch = metadata["general.architecture"]
    permuted = GGUF_ARCHITECTURES[arch][1]
    cuts = cuts_for(config) if cuts_for is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    file_quantization: dict[str, str] = {}
    int4_blocks: dict[str, Int4Blocks] = {}
    rope_tables: dict[str, list[float]] = {}  # Llama 3's rope_freqs, Phi-3's LongRoPE factors
    embedding_rows: GGUFTensor | None = None
    bar = tqdm(
        gguf_file.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress, file=sys.stderr
    )
    for t in bar:
        if t.name in _ROPE_TABLES:
            rope_tables[_ROPE_TABLES[t.name]] = dequantize(t.data, t.qtype, torch.float32).tolist()
            continue
        merged = merged_experts(t.name)
        if merged is not None:  # every expert of a layer in one 3-D tensor: one HF tensor each
            names = [expert_hf_name(merged[0], e, merged[1]) for e in range(t.shape[0])]
            pieces = [(n, t.data[e], None) for e, n in enumerate(names) if cuts.get(n) != NOT_HELD]
            tensors |= {n: torch.empty(0, dtype=dtype) for n in names if cuts.get(n) == NOT_HELD}
        else:
            hf_name = _gguf_to_hf_name(t.name, arch)
            assert hf_name is not None  # _check_gguf_shapes refused any other name
            pieces = [(hf_name, *read_cut(t, cuts.get(hf_name)))]
        matrix = len(t.shape) - (merged is not None) == 2
        for hf_name, raw, cut_after in pieces:
            # llama.cpp stores Gemma's norm weights as 1 + w; HF holds w (subtracted in float32)
            plus_one = arch == "gemma3" and hf_name.endswith("norm.weight")
            tensor = dequantize(raw, t.qtype, torch.float32 if plus_one else dtype)  # HF (row-major) shape
            if cut_after is not None:
                tensor = take_cut(tensor, cut_after)
            if plus_one:
                tensor = (tensor - 1.0).to(dtype)
            if hf_name == "model.embed_tokens.weight":
                embedding_rows = t
            heads = None  # per head, so a rank's whole heads unpermute alone
            if permuted and hf_name.endswith(
                ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
            ):
                heads = tensor.shape[0] // config.head_dim
            if heads is not None:
                tensor = _unpermute_rows(tensor, heads)
            if t.type_name in _FILE_QUANTIZATION:
                file_quantization[hf_name] = _FILE_QUANTIZATION[t.type_name]
            if keep_int4_blocks and t.type_name in INT4_BLOCK_TYPES and matrix:
                parts = q4k_blocks(raw) if t.type_name == "Q4_K" else q4_blocks(raw, t.type_name)
                if cut_after is not None:
                    parts = _cut_blocks(parts, cut_after)
                if heads is not None:  # the same row order as the dequantized weight
                    parts = tuple(_unpermute_rows(x, heads) for x in parts)
                q, scale, zero = (torch.from_numpy(np.ascontiguousarray(x)) for x in parts)
                int4_blocks[hf_name] = Int4Blocks(q=q, scale=scale, zero=zero)
            tensors[hf_name] = tensor.contiguous()
    tied = "lm_head.weight" not in tensors
    scaling = config.rope_scaling
    if "freqs" in rope_tables:  # Llama 3.x: llama.cpp stores the per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": rope_tables["freqs"]}
    if "long" in rope_tables and "short" in rope_tables:  # Phi-3's LongRoPE
        scaling = longrope_scaling(metadata, rope_tables["short"], rope_tables["long"])
    config = replace(config, tie_word_embeddings=tied, rope_scaling=scaling)
    check_tensor_set(config, tensors)
    gguf_file.drop_resident_pages()  # every tensor above is a copy now
    return LoadedWeights(config, tensors, metadata, file_quantization, int4_blocks, embedding_rows)


def _expected_shape(config: ModelConfig, hf_name: str) -> tuple[int, ...]:
    """The HF-layout shape a tensor must have for `config` (the model copies it in as is)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    hidden, ffn = c.hidden_size, c.intermediate_size
    part = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    norms = "model.norm input_layernorm post_attention_layernorm pre_feedforward_layernorm "
    norms += "post_feedforward_layernorm"
    shapes = {f"{name}.weight": (hidden,) for name in norms.split()}
    q_norm, k_norm = ((q,), (kv,)) if c.qk_norm_whole else ((c.head_dim,), (c.head_dim,))
    shapes |= {"self_attn.q_norm.weight": q_norm, "self_attn.k_norm.weight": k_norm}
    shapes |= {"model.embed_tokens.weight": (c.vocab_size, hidden), "lm_head.weight": (c.vocab_size, hidden)}
    for proj, out in (("q", q), ("k", kv), ("v", kv)):
        shapes |= {f"self_attn.{proj}_proj.weight": (out, hidden), f"self_attn.{proj}_proj.bias": (out,)}
    shapes |= {"self_attn.o_proj.weight": (hidden, q), "mlp.down_proj.weight": (hidden, ffn)}
    shapes |= {"mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden)}
    shapes |= {
        "self_attn.qkv_proj.weight": (q + 2 * kv, hidden),
        "mlp.gate_up_proj.weight": (2 * ffn, hidden),
    }
    expected = shapes.get(part) or (moe_expected_shape(c.moe, hidden, part) if c.moe is not None else None)
    if expected is None:  # an expert tensor in a file whose metadata declares no experts
        raise ModelLoadError(f"unexpected tensor {hf_name[:64]!r} for this model's metadata")
    return expected


def _check_gguf_shapes(config: ModelConfig, gguf_file: GGUFFile) -> None:
    """Every tensor's shape against the metadata, before any is dequantized: a mismatch
    would otherwise surface later as a reshape or copy error deep in loading."""
    for t in gguf_file.tensors:
        if t.name in _ROPE_TABLES:
            expected: tuple[int, ...] = (config.head_dim // 2,)
        else:
            merged = merged_experts(t.name)  # checked whole, by its GGUF name
            arch = gguf_file.metadata.get("general.architecture", "")
            hf_name = _gguf_to_hf_name(t.name, arch) if merged is None else f"model.layers.{t.name[4:]}"
            if hf_name is None:
                raise ModelLoadError(f"unexpected tensor {t.name[:64]!r} in a {config.architecture} GGUF")
            layer = re.match(r"model\.layers\.(\d+)\.", hf_name)
            if layer and int(layer.group(1)) >= config.num_hidden_layers:
                raise ModelLoadError(f"tensor {t.name} is past block_count {config.num_hidden_layers}")
            expected = _expected_shape(config, hf_name)
        if t.shape != expected:
            raise ModelLoadError(f"tensor {t.name} has shape {t.shape}, the metadata implies {expected}")


def check_tensor_set(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    required = required_tensor_names(config)
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ModelLoadError(f"model is missing {len(missing)} tensors, e.g. {missing[0]}")
    embed = tensors["model.embed_tokens.weight"]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"embedding shape {tuple(embed.shape)} does not match vocab {config.vocab_size} x hidden "
            f"{config.hidden_size}"
        )
