"""Prefix caching and chunked prefill change how much is computed per step, never the output.

fp32 throughout: the outputs are compared across engines whose steps have different shapes.
"""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams
from tests.engine import prompt_ids, words

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BLOCK = 16


def _llm(gguf, **kwargs) -> LLM:
    return LLM(
        str(gguf), dtype="float32", block_size=BLOCK, kv_cache_memory="256MiB", progress=False, **kwargs
    )


@pytest.fixture(scope="module")
def cached(default_gguf):
    return _llm(default_gguf, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def uncached(default_gguf):
    """The reference: no prefix cache, and a budget that takes a 2,000-token prompt in one step."""
    return _llm(default_gguf, max_num_batched_tokens=4096, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def chunked(default_gguf):
    return _llm(default_gguf, max_num_batched_tokens=256, enable_prefix_caching=False)


def _conversation(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Answer questions about this text.\n\n" + words(230, start=40)},
        {"role": "user", "content": question},
    ]


def _drained(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0


def test_shared_prefix_is_served_from_cache(cached, uncached):
    tok = cached.get_tokenizer()
    first, second = (
        tok.apply_chat_template(_conversation(q), add_generation_prompt=True, tokenize=True)
        for q in ("What do the farmers do in spring?", "Why do hikers carry a map?")
    )
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= 256, f"the test needs a 256+ token shared prefix, got {common}"

    out1 = cached.generate([first], GREEDY)[0]
    assert out1.num_cached_tokens == 0  # a fresh engine has nothing cached
    out2 = cached.generate([second], GREEDY)[0]
    # Every full block of the shared prefix is a hit, and nothing beyond it.
    assert out2.num_cached_tokens == common // BLOCK * BLOCK >= 240
    ref2 = uncached.generate([second], GREEDY)[0]
    assert ref2.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == ref2.outputs[0].token_ids
    assert out2.outputs[0].text == ref2.outputs[0].text

    # The very same prompt again: all full blocks but the one holding the last token hit.
    again = cached.generate([second], GREEDY)[0]
    assert again.num_cached_tokens == (len(second) - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == ref2.outputs[0].token_ids
    _drained(cached)


def test_chunked_prefill_equals_unchunked(chunked, uncached):
    long_prompt = prompt_ids(chunked.get_tokenizer(), 2000, offset=101)
    reference = uncached.generate([long_prompt], GREEDY)[0]  # the whole prompt in one step
    out = chunked.generate([long_prompt], GREEDY)[0]  # 8 steps of 256 tokens
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.outputs[0].text == reference.outputs[0].text
    _drained(chunked)


def test_decode_continues_while_a_long_prompt_prefills(chunked):
    """A long prompt arriving mid-decode is split over steps; the decode gets a token every step."""
    engine = chunked.engine
    tok = chunked.get_tokenizer()
    long_prompt = prompt_ids(tok, 1200, offset=333)
    short = prompt_ids(tok, 12, offset=7)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short_alone = chunked.generate([short], params)[0].outputs[0].token_ids

    engine.add_request("short", short, params)
    tokens: dict[str, list[int]] = {"short": [], "long": []}

    def step() -> set[str]:
        produced = set()
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.new_token_ids:
                produced.add(out.request_id)
        return produced

    for _ in range(3):
        assert step() == {"short"}
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    long_req = engine.scheduler.get_request("long")
    prefill_steps = 0
    while not tokens["long"]:
        before = long_req.num_computed_tokens
        produced = step()
        prefill_steps += 1
        # The decode never stalls behind the prefill, and the chunk fits the budget beside it.
        assert "short" in produced, f"the decode got no token in prefill step {prefill_steps}"
        assert 0 < long_req.num_computed_tokens - before <= 256 - 1
    assert prefill_steps >= len(long_prompt) // 256
    while engine.has_unfinished_requests():
        step()
    assert tokens["short"] == short_alone
    assert len(tokens["long"]) == 4
    _drained(chunked)
