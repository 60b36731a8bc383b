"""Phi-3 (fused Q/K/V and gate/up tensors, LongRoPE) against transformers on a tiny random
model whose trained context is 16 positions: fp32 logits within 1e-3 and greedy tokens
identical in both of LongRoPE's regimes (sequences within the trained context use the short
factors, longer ones the long factors), and the same model as a GGUF in llama.cpp's layout.

Where one sequence grows past the trained context during generation, transformers' generate()
throws its cache away and recomputes every position with the long factors; fornax, as vLLM,
keeps the K/V it has (rotated with the short factors) and uses the long factors from that step
on (docs/models.md). The test checks both regimes, not that crossing."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from tests.hf_reference import greedy_disagreement, logit_gap
from tests.model.tiny_models import build_tiny_model

TRAINED = 16
SHORT = [[5, 17, 99, 200], [250], [7, 8, 9, 10, 11, 12]]  # + 10 tokens: at most 16 positions
LONG = [list(range(40, 60)), [3] * 5 + list(range(100, 140))]  # past 16 from the first step


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    out = tmp_path_factory.mktemp("phi3")
    hf = build_tiny_model("phi3", out)
    return hf, LLM(str(out), dtype="float32", num_blocks=64, progress=False)


def test_config_mapped(phi3):
    _hf, llm = phi3
    c = llm.engine.model_config
    assert c.architecture == "Phi3ForCausalLM" and c.fused_projections
    assert c.rope_scaling["rope_type"] == "longrope"
    assert c.rope_scaling["original_max_position_embeddings"] == TRAINED
    assert c.rope_scaling["factor"] == 512 / TRAINED  # transformers' default: the context ratio


@pytest.mark.parametrize("ids", [SHORT[2], LONG[1]], ids=["short factors", "long factors"])
def test_logits_match_transformers(phi3, ids):
    hf, llm = phi3
    assert logit_gap(llm.engine.runner.model, hf, ids) < 1e-3


def test_greedy_matches_transformers_in_each_regime(phi3):
    hf, llm = phi3
    for prompts, n in ((SHORT, TRAINED - 6), (LONG, 24)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for prompt, out in zip(prompts, llm.generate(prompts, params)):  # batched together
            assert len(prompt) + n <= TRAINED or len(prompt) > TRAINED
            at = greedy_disagreement(hf, prompt, out.outputs[0].token_ids)
            assert at is None, f"prompt of {len(prompt)} tokens differs at token {at}"
    llm.engine.check_integrity()


def _write_phi3_gguf(hf, path) -> None:
    """The tiny Phi-3 as llama.cpp's converter writes it: fused attn_qkv and ffn_up (gate and
    up stacked), no Q/K permutation, LongRoPE's tables as rope_factors_* tensors."""
    import math

    import gguf

    from tests.model.test_gguf_loading import _GGUF_NAMES, _LAYER_NAMES, finish_gguf, start_gguf

    cfg, rope = hf.config, hf.config.rope_parameters
    writer = start_gguf(path, "phi3", cfg, rope["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(TRAINED)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_sliding_window(0)
    scale = cfg.max_position_embeddings / TRAINED
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(TRAINED)))
    names = {
        **_LAYER_NAMES,
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    }
    tensors = {}
    for name, tensor in hf.state_dict().items():
        layer = name.removeprefix("model.layers.").split(".", 1)
        tensors[_GGUF_NAMES.get(name) or f"blk.{layer[0]}.{names[layer[1]]}"] = tensor.float().numpy()
    for kind in ("long", "short"):
        tensors[f"rope_factors_{kind}.weight"] = torch.tensor(rope[f"{kind}_factor"]).numpy()
    finish_gguf(writer, tensors, gguf.GGMLQuantizationType.F32, lambda *_: False)


@pytest.mark.parametrize("ids", [SHORT[2], LONG[1]], ids=["short factors", "long factors"])
def test_gguf_matches_transformers(phi3, ids, tmp_path):
    from fornax.models import load_model

    hf, _llm = phi3
    path = tmp_path / "phi3.gguf"
    _write_phi3_gguf(hf, path)
    loaded = load_model(path, "float32", progress=False)
    assert loaded.config.fused_projections and loaded.config.sliding_window is None
    scaling = loaded.config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == TRAINED
    assert logit_gap(loaded.model, hf, ids) < 1e-3


def test_tensor_parallelism_is_refused_by_name(phi3):
    from fornax.config import ConfigError

    _hf, llm = phi3
    with pytest.raises(ConfigError, match=r"fused Q/K/V and gate/up tensors \(Phi-3\) are not split"):
        LLM(llm.engine.config.model, dtype="float32", tensor_parallel_size=2, progress=False)
