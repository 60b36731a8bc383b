"""Deterministic mode on the real default model: a request's tokens and logprobs are the same,
bit for bit, whatever it is batched with, whatever the prefix cache holds, however its prompt
is chunked, with n-gram speculation on or off, and at one thread or two; seeded sampling too.

Checked for both weight forms users run: bf16 (`--quantization none`) and `make run`'s
(`--quantization auto --large-step-quantization w8a8`). Each variation is a fresh engine run
against the first engine's results. The prompts share a system prompt of ~190 tokens, so
prefix-cache hits happen and each row's keys span more than one of the attention kernel's
fixed parts (layers/attention.py DETERMINISTIC_PART_KEYS). Without deterministic mode the
same comparison fails (checked by the last test, so this one cannot pass vacuously).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from fornax import LLM, SamplingParams
from tests.engine import OPEN, PARAGRAPHS

pytestmark = pytest.mark.slow

FORMS = {
    "bf16": {},
    "make-run": {"quantization": "auto", "large_step_quantization": "w8a8"},
}
# 8 open-ended prompts beside the 8 grounded ones
OPEN_PROMPTS = [*OPEN, "List four uses of copper.", "Why do owls hunt at night?"]
MAX_TOKENS = 8
# n-gram drafts on every step, whatever the planner would choose (it may decline at 32 requests).
NGRAM_ALWAYS = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "disable_by_batch_size": 0,
    "row_cost": 0.0,
    "draft_cost": 0.0,
}
# One greedy and one seeded sampled request per prompt: 32 requests in all.
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)


def _sampled(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, logprobs=2)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    system = "You are a careful assistant. Background notes: " + " ".join(PARAGRAPHS[8:10]) * 2
    texts = [f"Repeat after me: {p[:200]}" for p in PARAGRAPHS[:8]] + OPEN_PROMPTS
    return [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for t in texts
    ]


Result = tuple[tuple[int, ...], tuple[float, ...], tuple[tuple[int, ...], ...]]


def _run(llm: LLM, prompts: list[list[int]], which: Sequence[int]) -> dict[tuple[int, str], Result]:
    """Each chosen prompt once greedy and once sampled, all in one call: key (prompt, kind) ->
    (tokens, logprobs of the tokens, top-2 ids at each step)."""
    batch = [prompts[i] for i in which for _ in range(2)]
    params = [p for i in which for p in (GREEDY, _sampled(i))]
    outputs = llm.generate(batch, params)
    results = {}
    for n, out in enumerate(outputs):
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        logprobs = tuple(lp.logprob for lp in comp.logprobs)
        tops = tuple(tuple(lp.top_ids) for lp in comp.logprobs)
        results[(which[n // 2], "greedy" if n % 2 == 0 else "sampled")] = (
            tuple(comp.token_ids),
            logprobs,
            tops,
        )
    return results


def _differences(got: dict, want: dict) -> list[str]:
    return [f"{key}: {got[key][0]} != {want[key][0]}" for key in got if got[key] != want[key]]


def _engine(default_gguf: Path, form: str, **overrides) -> LLM:
    args = {"kv_cache_memory": "256MiB", "deterministic": True} | FORMS[form] | overrides
    return LLM(str(default_gguf), progress=False, **args)


@pytest.fixture(scope="module", params=list(FORMS))
def reference(request, default_gguf: Path) -> tuple[str, list[list[int]], dict]:
    """All 32 requests in one call of a fresh engine (prefix cache on, cold)."""
    form = request.param
    llm = _engine(default_gguf, form)
    prompts = _prompts(llm)
    want = _run(llm, prompts, range(len(prompts)))
    return form, prompts, want


def test_alone_subsets_and_warm_cache(reference, default_gguf: Path) -> None:
    """Each prompt alone, then random subsets, on one engine whose prefix cache is warm by then."""
    form, prompts, want = reference
    llm = _engine(default_gguf, form)
    got: dict = {}
    for i in range(len(prompts)):
        got |= _run(llm, prompts, [i])
    assert not _differences(got, want), f"{form}, alone"
    rng = random.Random(7)
    for size in (3, 7, 11):
        which = rng.sample(range(len(prompts)), size)
        got = _run(llm, prompts, which)
        assert not _differences(got, want), f"{form}, subset {which}"
    assert llm.engine.stats().prefix_cache_hits > 0  # the warm runs did hit the cache


def _chunks(tokens: int) -> dict:
    """Prompts prefilled in chunks of at most `tokens` tokens, beside the other requests' decodes."""
    return {"max_num_batched_tokens": tokens, "long_prefill_token_threshold": tokens}


# Each variation is one fresh engine (loading make run's forms takes a few seconds, so the
# variations are paired up rather than run one engine each).
VARIATIONS = {
    "chunks of 32, cold cache": _chunks(32) | {"enable_prefix_caching": False},
    "chunks of 72, n-gram drafts": _chunks(72) | {"speculative_config": NGRAM_ALWAYS},
    "chunks of 128, one thread": _chunks(128) | {"num_threads": 1},
}


@pytest.mark.parametrize("variation", list(VARIATIONS))
def test_variation(reference, default_gguf: Path, variation: str) -> None:
    form, prompts, want = reference
    threads = torch.get_num_threads()
    assert threads > 1, "the reference must run on more than one thread for this to mean anything"
    try:
        llm = _engine(default_gguf, form, **VARIATIONS[variation])  # sets torch's (process-wide) pool
        got = _run(llm, prompts, range(len(prompts)))
        stats = llm.engine.stats()
    finally:
        torch.set_num_threads(threads)
    assert not _differences(got, want), f"{form}, {variation}"
    if "n-gram" in variation:
        assert stats.spec_num_accepted_tokens_total > 0  # drafts were verified and taken


def test_two_tensor_parallel_ranks_give_one_process_bits(reference, default_gguf: Path) -> None:
    """Under tensor parallelism, deterministic mode splits O and down by output channel over
    gathered inputs (models/sharding.py, Shard.exact), so every value is computed over
    its whole row by one process's kernels in one process's order: two ranks give the
    reference's bits, all 32 requests together, in both weight forms (make run's: int4 from the
    file and int8 x int8, cut per rank). int8 / int4 / float32 forms were checked the same way
    by hand (8 prompts, 0 of 16 requests differ)."""
    form, prompts, want = reference
    llm = _engine(default_gguf, form, tensor_parallel_size=2)
    try:
        got = _run(llm, prompts, range(len(prompts)))
    finally:
        llm.engine.executor.close()
    assert not _differences(got, want), f"{form}, TP=2"


def test_default_mode_is_not_batch_invariant(default_gguf: Path) -> None:
    """The check above has teeth: without deterministic mode, the same prompts alone and
    together differ somewhere (weight forms switch with the step's row count)."""
    llm = LLM(str(default_gguf), progress=False, kv_cache_memory="256MiB")
    prompts = _prompts(llm)[:6]
    together = _run(llm, prompts, range(6))
    alone: dict = {}
    for i in range(6):
        alone |= _run(llm, prompts, [i])
    assert _differences(alone, together) or any(alone[k][1] != together[k][1] for k in alone)
