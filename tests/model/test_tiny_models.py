"""fp32 logits and greedy generation equal transformers' on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.native import load_paged_attention
from fornax.models.base import CausalLM, KVCache
from tests.model.tiny_models import build_tiny_model

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "qwen3_yarn", "gemma3"]
PROMPTS = [
    [5, 17, 99, 200, 31, 7],
    [3] * 3 + list(range(40, 80)),  # longer than Mistral's sliding window once generated
    [250],
]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, out)
    llm = LLM(str(out), dtype="float32", num_blocks=64, progress=False)
    return request.param, hf, llm


def test_config_mapped(tiny):
    arch, _hf, llm = tiny
    assert isinstance(llm.engine.runner.model, CausalLM)  # the interface the engine calls
    cfg = llm.engine.model_config
    assert cfg.qk_norm == (arch in ("qwen3", "qwen3_yarn", "gemma3"))
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == (arch in ("llama3", "gemma3"))
    if arch == "gemma3":
        assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.interleaves_sliding_window
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24)


def test_logits_match_transformers(tiny):
    _arch, hf, llm = tiny
    model = llm.engine.runner.model
    ids = PROMPTS[1]
    cache = KVCache(llm.engine.model_config, 8, 16, torch.float32)
    with torch.inference_mode():
        c = model.config
        meta = build_attention_metadata(
            [SeqSpan(0, len(ids), [2, 0, 5, 1])],
            16,
            c.sliding_window,
            interleaved=c.interleaves_sliding_window,
        )
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of 32 tokens."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt)),
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(tiny):
    arch, hf, llm = tiny
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # batched together through the engine
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt), f"{arch}: prompt {prompt[:5]}..."
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0


def test_torch_backend_matches_transformers(tiny):
    """The torch-ops path (no native kernels): the reference the kernels are tested against."""
    arch, _hf, llm = tiny
    ref_llm = LLM(
        llm.engine.config.model, dtype="float32", num_blocks=64, kernel_backend="torch", progress=False
    )
    assert ref_llm.engine.runner.attention_kernel is None
    if load_paged_attention() is not None:  # so the other tests here did run the kernels
        assert llm.engine.runner.attention_kernel is not None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    native = llm.generate(PROMPTS, params)
    torch_ops = ref_llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in torch_ops] == [o.outputs[0].token_ids for o in native], arch


def test_deterministic_mode_matches_transformers(tiny):
    """Deterministic mode (float32: its fixed-order matmul, every row on the paged kernel in
    fixed parts) keeps each family's greedy output equal to transformers', and a prompt alone
    gets the bits it gets beside the others."""
    arch, hf, llm = tiny
    det = LLM(llm.engine.config.model, dtype="float32", num_blocks=64, deterministic=True, progress=False)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)
    together = det.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt), f"{arch}: prompt {prompt[:5]}..."
        alone = det.generate([prompt], params)[0].outputs[0]
        assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in out.outputs[0].logprobs], arch
