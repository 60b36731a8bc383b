"""Continuous batching end to end: batched == alone == transformers, preemption, abort, bad input.

Exactness checks run in fp32: bf16 matmuls round differently for different batch shapes,
which can flip a greedy near-tie without any bug.
"""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.request import RequestStatus, SamplingParamsError
from tests.engine import prompt_ids, words
from tests.hf_reference import greedy_disagreement
from tests.model.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _mixed_prompts(tok, raw_lengths: list[int], chat_words: list[int]) -> list[list[int]]:
    """Raw token-id prompts of exact lengths plus chat-templated ones, interleaved."""
    raw = [prompt_ids(tok, n, offset=37 * i) for i, n in enumerate(raw_lengths)]
    chat = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Summarise this: {words(n, start=11 * i)}"}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i, n in enumerate(chat_words)
    ]
    mixed: list[list[int]] = []
    for i in range(max(len(raw), len(chat))):
        mixed.extend(raw[i : i + 1] + chat[i : i + 1])
    return mixed


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_drained(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


# -- the default model --


@pytest.fixture(scope="module")
def llm(default_gguf):
    """fp32, no prefix caching: 'alone' runs must not reuse blocks the batched run computed."""
    return LLM(
        str(default_gguf),
        dtype="float32",
        enable_prefix_caching=False,
        kv_cache_memory="256MiB",
        progress=False,
    )


@pytest.fixture(scope="module")
def small_llm(default_gguf):
    """A KV cache far too small for its batch: 24 blocks of 16 tokens for 8 sequences."""
    return LLM(
        str(default_gguf), dtype="float32", num_blocks=24, block_size=16, max_num_seqs=8, progress=False
    )


@pytest.mark.slow
def test_default_model_batched_equals_alone(llm):
    tok = llm.get_tokenizer()
    prompts = _mixed_prompts(tok, [1, 2, 5, 16, 33, 97, 256, 600], [1, 8, 30, 70, 120, 200, 300])
    prompts.append(tok.encode("Q: What is the capital of Italy?\nA:"))
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16 and lengths[0] == 1 and lengths[-1] >= 550
    together = llm.generate(prompts, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert all(len(t) == 24 for t in _token_ids(together))
    mismatched = [i for i, (a, b) in enumerate(zip(_token_ids(together), _token_ids(alone))) if a != b]
    assert not mismatched, f"prompts {mismatched} (lengths {[len(prompts[i]) for i in mismatched]})"
    assert [o.outputs[0].text for o in together] == [o.outputs[0].text for o in alone]
    _assert_drained(llm)


@pytest.mark.slow
def test_preemption_gives_the_same_outputs(llm, small_llm):
    tok = llm.get_tokenizer()
    prompts = [prompt_ids(tok, 56 + i, offset=53 * i) for i in range(8)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    reference = llm.generate(prompts, params)
    constrained = small_llm.generate(prompts, params)
    assert small_llm.engine.scheduler.num_preemptions_total > 0
    assert any(o.timings["num_preemptions"] > 0 for o in constrained)
    assert _token_ids(constrained) == _token_ids(reference)
    assert all(o.outputs[0].finish_reason == "length" for o in constrained)
    _assert_drained(small_llm)


@pytest.mark.slow
def test_abort_mid_generation_frees_everything(small_llm):
    engine = small_llm.engine
    tok = small_llm.get_tokenizer()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = [f"ab{i}" for i in range(10)]  # 10 > max_num_seqs: the last ones wait
    for i, rid in enumerate(ids):
        p = SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=5) if rid == "ab1" else params
        engine.add_request(rid, prompt_ids(tok, 40, offset=29 * i), p)
    finals: dict[tuple[str, int], str | None] = {}
    counts: dict[tuple[str, int], int] = {}

    def collect(outs) -> None:
        for out in outs:
            key = (out.request_id, out.index)
            assert key not in finals, f"{key} produced output after it finished"
            counts[key] = counts.get(key, 0) + len(out.new_token_ids)
            if out.finished:
                finals[key] = out.finish_reason

    for _ in range(3):
        collect(engine.step())
    assert engine.scheduler.get_request("ab0").status == RequestStatus.RUNNING
    assert engine.scheduler.get_request("ab1#0").status == RequestStatus.RUNNING  # n=2: children ab1#0, ab1#1
    queued = engine.scheduler.waiting
    waiting = [r.request_id for r in queued if r.request_id in ids and not r.num_output_tokens]
    assert waiting, "the test needs a request that has not started yet"
    victims = ["ab0", "ab1", waiting[-1]]  # running, running with a sibling, waiting
    for rid in victims:
        engine.abort_request(rid)
    engine.abort_request("no-such-request")  # unknown ids are ignored
    while engine.has_unfinished_requests():
        collect(engine.step())
    aborted = {("ab0", 0), ("ab1", 0), ("ab1", 1), (waiting[-1], 0)}
    assert {k for k, reason in finals.items() if reason == "abort"} == aborted
    assert set(finals) == aborted | {(rid, 0) for rid in ids if rid not in victims}
    assert all(counts[k] == 20 for k in finals if k not in aborted)
    assert counts[(waiting[-1], 0)] == 0 and 0 < counts[("ab0", 0)] < 20
    _assert_drained(small_llm)


def test_prompt_longer_than_context_is_rejected(llm):
    max_len = llm.engine.max_model_len
    too_long = [100] * (max_len + 5)
    with pytest.raises(ValueError) as err:
        llm.generate([too_long], GREEDY)
    assert str(max_len + 5) in str(err.value) and str(max_len) in str(err.value)
    # A bad prompt in a list rejects the call without leaving the good ones behind.
    with pytest.raises(ValueError):
        llm.generate([[100, 200, 300], too_long], GREEDY)
    _assert_drained(llm)
    out = llm.generate([[100, 200, 300]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
    _assert_drained(llm)


def test_out_of_vocab_and_empty_prompts_are_rejected(llm):
    vocab = llm.engine.model_config.vocab_size
    for bad, culprit in (([1, 2, vocab], vocab), ([-1, 5], -1)):
        with pytest.raises(ValueError, match=f"token id {culprit} "):
            llm.generate([bad], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([""], GREEDY)
    with pytest.raises(SamplingParamsError) as err:
        llm.generate(["hi"], SamplingParams(stop_token_ids=[vocab + 1]))
    assert err.value.param == "stop_token_ids"
    _assert_drained(llm)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


# -- a tiny random model, against transformers too --


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama")
    hf = build_tiny_model("llama", out)
    llm = LLM(str(out), dtype="float32", enable_prefix_caching=False, num_blocks=512, progress=False)
    return hf, llm


def test_tiny_model_batched_equals_alone_and_transformers(tiny):
    hf, llm = tiny
    tok = llm.get_tokenizer()
    # The tiny model's context is 512: the longest prompt leaves room for 24 new tokens.
    prompts = _mixed_prompts(tok, [1, 2, 7, 16, 17, 64, 150, 300, 480], [1, 3, 8, 15, 30, 50, 80])
    assert len(prompts) >= 16 and max(len(p) for p in prompts) <= 512 - 24
    together = llm.generate(prompts, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert _token_ids(together) == _token_ids(alone)
    for prompt, out in zip(prompts, together):
        at = greedy_disagreement(hf, prompt, out.outputs[0].token_ids)
        assert at is None, f"prompt of {len(prompt)} tokens: not transformers' token at {at}"
    _assert_drained(llm)
