"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers on the same file, fp32."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.models.base import KVCache
from tests.hf_reference import greedy_disagreement, one_gguf_parse

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "什么是 LLM 推理？",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "Translate to German: Good morning, how are you?",
    "🚀 Rockets work because",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "A haiku about autumn:\n",
]


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    from transformers import AutoModelForCausalLM

    with one_gguf_parse():
        model = AutoModelForCausalLM.from_pretrained(
            str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(str(default_gguf), dtype="float32", progress=False)


def test_logits_match_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Explain prefill and decode in one paragraph."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    model = llm.engine.runner.model
    cache = KVCache(llm.engine.model_config, 16, 16, torch.float32)
    with torch.inference_mode():
        blocks = list(range(15, 15 - (len(ids) + 15) // 16, -1))  # non-contiguous, reversed blocks
        meta = build_attention_metadata([SeqSpan(0, len(ids), blocks)], 16)
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def _greedy_mismatches(llm: LLM, hf_model) -> list[tuple[str, str, int]]:
    """Prompts whose 32 greedy tokens are not transformers': (prompt, our text, first bad position)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    found = [(p, o, greedy_disagreement(hf_model, p, o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    return [(tok.decode(p), o.outputs[0].text, at) for p, o, at in found if at is not None]


def test_greedy_matches_transformers(llm, hf_model):
    assert not _greedy_mismatches(llm, hf_model)
    llm.engine.check_integrity()


def test_deterministic_fp32_matches_transformers_and_itself(default_gguf, hf_model):
    """Deterministic mode in float32 (its own fixed-order kernels): the same greedy tokens as
    transformers, and each prompt alone gives the bits it gives among the others."""
    llm = LLM(
        str(default_gguf), dtype="float32", deterministic=True, progress=False, kv_cache_memory="256MiB"
    )
    assert not _greedy_mismatches(llm, hf_model)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)

    def key(out) -> tuple:
        comp = out.outputs[0]
        return tuple(comp.token_ids), tuple(lp.logprob for lp in comp.logprobs)

    together = [key(o) for o in llm.generate(prompts, params)]
    alone = [key(llm.generate([p], params)[0]) for p in prompts]
    assert alone == together
