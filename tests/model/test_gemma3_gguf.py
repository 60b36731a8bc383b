"""Gemma 3 270M's real GGUF (Q4_K_M) against HF transformers loading the same file: the
tokenizer's ids, fp32 logits within 1e-3 and 32 greedy tokens identical, on English,
Chinese and code prompts."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.models.base import KVCache
from tests.hf_reference import greedy_disagreement, one_gguf_parse

PROMPTS = [
    "The capital of France is",
    "什么是 LLM 推理？",
    "大型语言模型的推理过程分为预填充和解码两个阶段，",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Translate to French: I would like a cup of coffee.",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def pair(gemma3_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = LLM(
        str(gemma3_gguf), dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, progress=False
    )
    root, name = str(gemma3_gguf.parent), gemma3_gguf.name
    with one_gguf_parse():
        hf = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32).eval()
        hf_tokenizer = AutoTokenizer.from_pretrained(root, gguf_file=name)
    return ours, hf, hf_tokenizer


def test_config_from_the_file(pair):
    ours, hf, _ = pair
    c = ours.engine.model_config
    assert c.architecture == "Gemma3ForCausalLM" and c.vocab_size == 262144 and c.tie_word_embeddings
    assert c.layer_types == tuple(hf.config.layer_types) and c.interleaves_sliding_window
    assert (c.sliding_window, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 10000.0, 256.0)


def test_tokenizer_matches_transformers(pair):
    ours, _, hf_tokenizer = pair
    tokenizer = ours.engine.tokenizer
    for prompt in PROMPTS:
        assert tokenizer.encode(prompt) == hf_tokenizer(prompt)["input_ids"], prompt


def test_logits_match_transformers(pair):
    ours, hf, _ = pair
    model, tokenizer = ours.engine.runner.model, ours.engine.tokenizer
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        cache = KVCache(model.config, 4, 16, torch.float32)
        with torch.inference_mode():
            meta = build_attention_metadata(
                [SeqSpan(0, len(ids), [3, 1])], 16, model.config.sliding_window, interleaved=True
            )
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
            ref = hf(torch.tensor([ids])).logits[0]
        assert (logits - ref).abs().max().item() < 1e-3, prompt


def test_greedy_matches_transformers(pair):
    ours, hf, _ = pair
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = ours.generate(PROMPTS, params)  # batched together through the engine
    for prompt, out in zip(PROMPTS, outs):
        assert greedy_disagreement(hf, out.prompt_token_ids, out.outputs[0].token_ids) is None, prompt
    ours.engine.check_integrity()


def test_gemma_turn_format_when_the_file_has_no_template(gemma3_gguf):
    from fornax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_file(gemma3_gguf)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " 什么是 LLM 推理？ "},
        {"role": "assistant", "content": "Inference."},
        {"role": "user", "content": "More?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n什么是 LLM 推理？<end_of_turn>\n"
        "<start_of_turn>model\nInference.<end_of_turn>\n<start_of_turn>user\nMore?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert tokenizer.backend.token_to_id("<end_of_turn>") in tokenizer.eos_token_ids  # a turn's end stops
