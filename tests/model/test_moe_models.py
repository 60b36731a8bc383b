"""Mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with a
dense layer among sparse ones) against transformers on tiny random models built here: the
config's routing, fp32 logits within 1e-3, 32 greedy tokens identical for prompts batched
together, routing ties broken as transformers breaks them, and the quantized forms running
on every expert (models/moe.py)."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.config import ConfigError
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.models import ModelLoadError
from fornax.models.moe import SparseMoE
from tests.hf_reference import greedy_disagreement
from tests.model.tiny_models import build_tiny_model

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
PROMPTS = [[5, 17, 99, 200, 31, 7], [3] * 3 + list(range(40, 80)), [250], list(range(300, 340, 3))]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, out)
    llm = LLM(str(out), dtype="float32", num_blocks=64, progress=False)
    return request.param, hf, llm, out


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    from fornax.models.base import KVCache

    model = llm.engine.runner.model
    cache = KVCache(llm.engine.model_config, 8, 16, torch.float32)
    with torch.inference_mode():
        meta = build_attention_metadata([SeqSpan(0, len(ids), [2, 0, 5, 1])], 16, model.config.sliding_window)
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))


def test_routing_config_mapped(tiny):
    arch, _hf, llm, _ = tiny
    moe = llm.engine.model_config.moe
    assert moe is not None
    expected = {
        "mixtral": (4, 2, True, (0, 1), 0),
        "qwen2_moe": (6, 2, False, (0, 1), 96),
        "qwen3_moe": (8, 3, True, (0,), 0),  # layer 1 is in mlp_only_layers
    }[arch]
    got = (
        moe.num_experts,
        moe.top_k,
        moe.normalize_top_k,
        moe.sparse_layers,
        moe.shared_expert_intermediate_size,
    )
    assert got == expected
    layers = llm.engine.runner.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [
        i in moe.sparse_layers for i in range(2)
    ]


def test_logits_match_transformers(tiny):
    _arch, hf, llm, _ = tiny
    for ids in PROMPTS:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (_logits(llm, ids) - ref).abs().max().item() < 1e-3


def test_greedy_matches_transformers_batched(tiny):
    arch, hf, llm, _ = tiny
    outs = llm.generate(PROMPTS, GREEDY)  # batched: each step's tokens grouped by expert together
    for prompt, out in zip(PROMPTS, outs):
        at = greedy_disagreement(hf, prompt, out.outputs[0].token_ids)
        assert at is None, f"{arch}: prompt {prompt[:4]}... differs from transformers at token {at}"
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0


def test_routing_ties_break_as_in_transformers(tiny, tmp_path):
    """A router of zeros gives every expert the same probability: which top-k it picks is
    then torch.topk's tie rule alone, and must be transformers' (the same experts, so the
    same logits)."""
    _arch, hf, _llm, src = tiny
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(src, tied)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tied / "model.safetensors"))
    name = next(n for n in tensors if n.endswith(".gate.weight") and ".layers.0." in n)
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        hf_tied = type(hf).from_pretrained(str(tied), dtype=torch.float32).eval()
        ids = PROMPTS[1]
        ref = hf_tied(torch.tensor([ids])).logits[0]
    llm = LLM(str(tied), dtype="float32", num_blocks=16, progress=False)
    weights, _experts = llm.engine.runner.model.layers[0].mlp.route(torch.randn(3, 64))
    assert (weights == weights[0, 0]).all()  # a true tie: every pick has the same weight
    assert (_logits(llm, ids) - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("quantization", ["int8", "int4", "auto"])
def test_quantized_experts_run_close_to_float(tiny, quantization):
    """Each expert's projections take the planned integer forms (bf16 model, make run's w8a8
    large steps): the outputs stay close to the float model's, tokens are produced, nothing leaks."""
    _arch, _hf, ref_llm, src = tiny
    llm = LLM(str(src), dtype="bfloat16", quantization=quantization, num_blocks=64, progress=False)
    model = llm.engine.runner.model
    if quantization != "auto":  # "auto" keeps float tensors dense
        assert model.has_quantized_small_steps()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    want = ref_llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))
    # the first token's logprob under the float model vs this form: close, not equal
    for o, w in zip(outs, want):
        assert abs(o.outputs[0].logprobs[0].logprob - w.outputs[0].logprobs[0].logprob) < 0.5
    llm.engine.check_integrity()


def test_modes_not_supported_yet_are_refused_by_name(tiny):
    _arch, _hf, _llm, src = tiny
    with pytest.raises(ModelLoadError, match="deterministic mode does not run mixture-of-experts"):
        LLM(str(src), dtype="float32", deterministic=True, num_blocks=16, progress=False)
    with pytest.raises(
        (ConfigError, ModelLoadError, ValueError), match="mixture-of-experts model runs in one process"
    ):
        LLM(str(src), dtype="float32", tensor_parallel_size=2, num_blocks=16, progress=False)
