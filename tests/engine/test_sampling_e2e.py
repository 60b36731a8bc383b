"""Sampling through the whole engine: seeds, n, top-k, logprobs and prompt logprobs.

The default model runs in fp32 so that a seeded draw cannot land on the other side of a
CDF boundary because a different batch shape rounded the logits differently.
"""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from tests.engine import prompt_ids
from tests.model.tiny_models import build_tiny_model

SEEDED = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 24}


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(str(default_gguf), dtype="float32", kv_cache_memory="256MiB", progress=False)


@pytest.fixture(scope="module")
def prompt(llm):
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    return llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def _ids(out, index: int = 0) -> list[int]:
    return out.outputs[index].token_ids


@pytest.mark.slow
def test_seed_is_reproducible_across_batch_compositions(llm, prompt):
    tok = llm.get_tokenizer()
    seeded = SamplingParams(seed=1234, **SEEDED)
    alone = llm.generate([prompt], seeded)[0]
    others = [prompt_ids(tok, 5 + 40 * i, offset=17 * i) for i in range(5)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=8 + 6 * i) for i in range(5)]
    batch = llm.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [seeded] + other_params[2:])
    assert _ids(batch[2]) == _ids(alone) and len(_ids(alone)) == 24
    assert batch[2].outputs[0].text == alone.outputs[0].text
    other_seed = llm.generate([prompt], SamplingParams(seed=1235, **SEEDED))[0]
    assert _ids(other_seed) != _ids(alone)


@pytest.mark.slow
def test_n_samples_are_distinct_and_seeded(llm, prompt):
    params = SamplingParams(n=2, seed=77, **SEEDED)
    first = llm.generate([prompt], params)[0]
    assert [c.index for c in first.outputs] == [0, 1] and first.finished
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in first.outputs)
    assert _ids(first, 0) != _ids(first, 1)
    # Again, this time next to another request: the same two samples.
    neighbour = prompt_ids(llm.get_tokenizer(), 50)
    again = llm.generate([prompt, neighbour], [params, SamplingParams(max_tokens=5)])[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0


@pytest.mark.slow
def test_top_k_1_and_logprobs_follow_greedy(llm, prompt):
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    top1 = llm.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True))[0]
    assert _ids(top1) == _ids(greedy)

    lp_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    with_lp = llm.generate([prompt], lp_params)[0]
    comp = with_lp.outputs[0]
    assert comp.token_ids == _ids(greedy)  # asking for logprobs does not change the choice
    assert comp.logprobs is not None and len(comp.logprobs) == 24
    for token, lp in zip(comp.token_ids, comp.logprobs):
        assert lp.token_id == token and lp.rank == 1
        assert len(lp.top_ids) == 5 and len(lp.top_logprobs) == 5
        assert lp.top_ids[0] == token and lp.top_logprobs[0] == pytest.approx(lp.logprob, abs=1e-6)
        assert all(a >= b for a, b in zip(lp.top_logprobs, lp.top_logprobs[1:])) and lp.logprob <= 0.0
    assert comp.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in comp.logprobs), abs=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama-lp")
    hf = build_tiny_model("llama", out)
    # A small budget splits the prompt over steps, so prompt logprobs are gathered in chunks.
    llm = LLM(str(out), dtype="float32", num_blocks=128, max_num_batched_tokens=64, progress=False)
    return hf, llm


def test_prompt_logprobs_match_transformers(tiny):
    hf, llm = tiny
    prompt = prompt_ids(llm.get_tokenizer(), 150, offset=3)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)  # [P-1, vocab]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    # Twice: the second run must not take its prompt from the prefix cache and lose the scores.
    for out in llm.generate([prompt], params) + llm.generate([prompt], params):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for pos, entry in enumerate(entries[1:]):
            row, token = ref[pos], prompt[pos + 1]
            assert entry is not None and entry.token_id == token
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
            assert entry.rank == 1 + int((row > row[token]).sum())
            top = torch.topk(row, 3)
            assert entry.top_ids == top.indices.tolist()
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-3)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0
