"""GGUF loading: quant types, llama.cpp's Q/K permutation, and clear errors for bad files.

GGUF files are written here with the `gguf` package's own writer from a tiny transformers
model, so every check compares against an independent reference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fornax.models import load_model
from fornax.models.loader import ModelLoadError, load_gguf
from fornax.models.registry import ModelSourceError, resolve_model
from tests.hf_reference import logit_gap
from tests.model.tiny_models import build_tiny_model

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (pairs interleaved per head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def start_gguf(path: Path, arch: str, cfg, rope_theta: float) -> gguf.GGUFWriter:
    """A writer for `arch` with the shape keys every decoder's GGUF has, from a transformers config."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def write_llama_gguf(
    hf_model, path: Path, qtype: Q = Q.F32, arch: str = "llama", yarn: dict | None = None
) -> dict[str, np.ndarray]:
    """Write a tiny HF Llama as a llama.cpp-style GGUF; returns the dequantized reference of each
    tensor. yarn: YaRN's factor and trained context, as llama.cpp's converter writes them."""
    cfg = hf_model.config
    writer = start_gguf(path, arch, cfg, rope_theta=10000.0)
    if yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER_NAMES[rest]}"
        else:
            gguf_name = _GGUF_NAMES[name]
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        tensors[gguf_name] = w
    return finish_gguf(writer, tensors, qtype, lambda _name, w: w.ndim == 2)


def finish_gguf(writer, tensors: dict[str, np.ndarray], qtype: Q, quantize) -> dict[str, np.ndarray]:
    """Add `tensors` (those `quantize(name, array)` picks in `qtype`, the rest float32), write
    the file and close it; returns what each tensor dequantizes to, by name."""
    reference = {}
    for name, w in tensors.items():
        if qtype != Q.F32 and quantize(name, w):
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            reference[name] = gguf.quants.dequantize(data, qtype)
        else:
            writer.add_tensor(name, w)
            reference[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return build_tiny_model("llama", out)


def test_permuted_f32_gguf_matches_transformers(tiny_llama, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(tiny_llama, path)
    loaded = load_model(path, "float32", progress=False)
    assert logit_gap(loaded.model, tiny_llama, list(range(3, 40))) < 1e-3


def test_yarn_gguf_matches_transformers_past_the_trained_context(tmp_path):
    """GGUF's rope.scaling.* keys for YaRN (type, factor, original context) give transformers'
    logits at positions 16-39, past the 16 positions the model is said to be trained on."""
    import transformers

    yarn = {"factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
    )
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.15 * torch.randn_like(p))
    path = tmp_path / "yarn.gguf"
    write_llama_gguf(hf, path, yarn=yarn)
    loaded = load_model(path, "float32", progress=False)
    assert loaded.config.rope_scaling == {"rope_type": "yarn", **yarn}
    assert logit_gap(loaded.model, hf, list(range(3, 43))) < 1e-3  # positions 16-39 past it


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_quant_types_dequantize_like_gguf(tiny_llama, tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    reference = write_llama_gguf(tiny_llama, path, qtype)
    weights = load_gguf(path, torch.float32, progress=False)
    # Q/K come back un-permuted, everything else as written.
    cfg = weights.config
    q_ref = _unpermute(reference["blk.0.attn_q.weight"], cfg.num_attention_heads)
    assert np.array_equal(weights.tensors["model.layers.0.self_attn.q_proj.weight"].numpy(), q_ref)
    down = weights.tensors["model.layers.1.mlp.down_proj.weight"].numpy()
    assert np.array_equal(down, reference["blk.1.ffn_down.weight"])


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant blocks: sane fp16 scales, random quants and sub-scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_elems
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin at the start
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    else:  # Q6_K: d at the end
        raw[:, -2:] = scale
    return raw.reshape(rows, cols // block_elems * block_bytes)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_dequantize_like_gguf(tmp_path, qtype):
    rng = np.random.default_rng(0)
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = _random_k_blocks(qtype, 8, 512, rng)
    writer.add_tensor("blk.0.ffn_down.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from fornax.gguf_file import GGUFFile

    (tensor,) = GGUFFile(path).tensors
    assert tensor.shape == (8, 512) and tensor.qtype == qtype
    ours = gguf.quants.dequantize(tensor.data, tensor.qtype)
    assert np.array_equal(ours, gguf.quants.dequantize(data, qtype))
    assert np.isfinite(ours).all() and ours.std() > 0


# -- bad input: one clear error, never a traceback --


def test_missing_file_and_unknown_alias(tmp_path):
    with pytest.raises(ModelSourceError, match="not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelSourceError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


def test_corrupt_and_truncated_gguf(tiny_llama, tmp_path):
    good = tmp_path / "good.gguf"
    write_llama_gguf(tiny_llama, good)
    blob = good.read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + blob[4:])
    with pytest.raises(ModelLoadError, match="bad magic"):
        load_gguf(bad_magic, torch.float32, progress=False)
    for cut, message in [(100, "truncated"), (len(blob) - 64, "truncated")]:
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(blob[:cut])
        with pytest.raises(ModelLoadError, match=message):
            load_gguf(short, torch.float32, progress=False)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        load_gguf(empty, torch.float32, progress=False)


def test_unsupported_architecture_and_quant_type(tiny_llama, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(tiny_llama, path, arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(path, torch.float32, progress=False)
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((2, 84), dtype=np.uint8), raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF quant type Q2_K"):
        load_gguf(path, torch.float32, progress=False)


def test_bad_hf_directories(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelSourceError, match=r"no \*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path, "float32", progress=False)


def test_cli_prints_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"hello, not a model")
    for model in [str(bad), str(tmp_path / "missing.gguf"), "no-such-alias"]:
        proc = subprocess.run(
            [sys.executable, "-m", "fornax.cli", "generate", "hi", "--model", model],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1
        assert "Traceback" not in proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("fornax: error:"), proc.stderr


# -- the torch dequantizers (layers/dequantize.py) against the gguf package's --

# Byte offsets of each block's float16 scales (the rest of a block is any bytes at all).
_SCALE_BYTES = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.BF16: [],
}


def _random_blocks(qtype: Q, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random packed rows whose float16 scales are finite (normal, subnormal and zero ones)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    blocks = data.reshape(-1, block_bytes)
    for start in _SCALE_BYTES[qtype]:
        scales = rng.standard_normal(len(blocks)) * rng.choice([1e-6, 1e-3, 1.0, 100.0], len(blocks))
        scales[:: max(1, len(blocks) // 3)] = 0.0
        blocks[:, start : start + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data


@pytest.mark.parametrize("qtype", list(_SCALE_BYTES), ids=lambda q: q.name)
def test_torch_dequantizers_equal_the_gguf_packages_bit_for_bit(qtype, monkeypatch):
    from gguf.quants import dequantize as reference

    from fornax.layers import dequantize as deq

    monkeypatch.setattr(deq, "SLICE_VALUES", 1000)  # several slices per tensor, and a last short one
    data = _random_blocks(qtype, rows=13, blocks_per_row=3, rng=np.random.default_rng(int(qtype)))
    want = torch.from_numpy(np.ascontiguousarray(reference(data, qtype), dtype=np.float32))
    got = deq.dequantize(data, qtype, torch.float32)
    assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(deq.dequantize(data, qtype, torch.bfloat16), want.to(torch.bfloat16))
    one_row = deq.dequantize(data[3], qtype, torch.float32)  # a 1-D tensor keeps its shape
    assert torch.equal(one_row, want[3])


def test_dequantize_takes_float_tensors_and_other_types_through_the_reference():
    from gguf.quants import dequantize as reference
    from gguf.quants import quantize

    from fornax.layers.dequantize import BLOCK_DEQUANTIZERS, dequantize

    values = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    assert torch.equal(dequantize(values, Q.F32, torch.float32), torch.from_numpy(values))
    half = values.astype(np.float16)
    assert torch.equal(dequantize(half, Q.F16, torch.bfloat16), torch.from_numpy(half).float().bfloat16())
    assert Q.TQ1_0 not in BLOCK_DEQUANTIZERS  # no torch form: the reference runs
    packed = quantize(values, Q.TQ1_0)
    assert torch.equal(
        dequantize(packed, Q.TQ1_0, torch.float32), torch.from_numpy(reference(packed, Q.TQ1_0))
    )
