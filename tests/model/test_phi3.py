"""Phi-3 (fused Q/K/V and gate/up tensors, LongRoPE) against transformers on a tiny random
model whose trained context is 16 positions: fp32 logits within 1e-3 and greedy tokens
identical in both of LongRoPE's regimes (sequences within the trained context use the short
factors, longer ones the long factors).

Where one sequence grows past the trained context during generation, transformers' generate()
throws its cache away and recomputes every position with the long factors; fornax, as vLLM,
keeps the K/V it has (rotated with the short factors) and uses the long factors from that step
on (docs/models.md). The test checks both regimes, not that crossing."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.models.base import KVCache
from tests.hf_reference import greedy_disagreement
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
    model = llm.engine.runner.model
    cache = KVCache(llm.engine.model_config, 8, 16, torch.float32)
    with torch.inference_mode():
        meta = build_attention_metadata([SeqSpan(0, len(ids), [2, 0, 5, 1])], 16)
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_matches_transformers_in_each_regime(phi3):
    hf, llm = phi3
    for prompts, n in ((SHORT, TRAINED - 6), (LONG, 24)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for prompt, out in zip(prompts, llm.generate(prompts, params)):  # batched together
            assert len(prompt) + n <= TRAINED or len(prompt) > TRAINED
            at = greedy_disagreement(hf, prompt, out.outputs[0].token_ids)
            assert at is None, f"prompt of {len(prompt)} tokens differs at token {at}"
    llm.engine.check_integrity()
