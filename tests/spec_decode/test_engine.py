"""Speculative decoding end to end on tiny random models: lossless for every proposer, the
sampled distribution kept, seeded runs reproducible, no leaked blocks.

fp32 throughout, so "lossless" can be checked as exact equality: the verify step computes the
same positions as plain decoding, in a different batch shape, and fp32 keeps that below the
logit gaps of these peaked tiny models.
"""

from __future__ import annotations

from collections import Counter

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.request import RequestStatus
from tests.model.tiny_models import TRAIN_TEXT, build_tiny_model

PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "self-layers": {"method": "self", "draft_layers": 1, "num_speculative_tokens": 2},
    "self-int4": {"method": "self", "quantization": "int4", "num_speculative_tokens": 4},
    "draft": {"method": "draft", "num_speculative_tokens": 3},  # model: the second tiny model
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    build_tiny_model("llama", target, seed=0)
    build_tiny_model("llama", draft, seed=1)  # same tokenizer and vocabulary, other weights
    return target, draft


# Speculate on every decode: no batch limit, drafts priced at nothing (so every one pays).
ALWAYS = {"disable_by_batch_size": 0, "row_cost": 0.0, "draft_cost": 0.0}


def _llm(target, spec: dict | None = None, **kw) -> LLM:
    spec = None if spec is None else {**spec, **ALWAYS}
    kw = {"dtype": "float32", "progress": False, "block_size": 4, "num_blocks": 256} | kw
    return LLM(str(target), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def baseline(models):
    return _llm(models[0])


def _prompts(tok) -> list[list[int]]:
    # Repetitive text (n-gram hits) and plain text, short and long.
    texts = [TRAIN_TEXT[0] + " " + TRAIN_TEXT[0][:40], TRAIN_TEXT[1] * 2, TRAIN_TEXT[2], "The", TRAIN_TEXT[3]]
    return [tok.encode(t) for t in texts] + [[5, 6, 7, 8] * 6]


PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=33, temperature=0.0, logprobs=3, frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(
        max_tokens=30, temperature=0.0, repetition_penalty=1.3, logit_bias={10: 2.0}, min_tokens=12
    ),
    SamplingParams(max_tokens=37, temperature=0.0, stop=["e "], stop_token_ids=[40]),
]


def _spec_config(name: str, draft_dir) -> dict:
    cfg = dict(PROPOSERS[name])
    if cfg["method"] == "draft":
        cfg["model"] = str(draft_dir)
    return cfg


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_outputs_equal_plain_decoding(models, baseline, name):
    spec = _llm(models[0], _spec_config(name, models[1]))
    tok = spec.get_tokenizer()
    prompts = _prompts(tok)
    for params in PARAMS:
        ref = baseline.generate(prompts, params)
        got = spec.generate(prompts, params)
        for r, g in zip(ref, got):
            a, b = r.outputs[0], g.outputs[0]
            assert b.token_ids == a.token_ids, (params, a.text, b.text)
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
            if params.logprobs is not None:
                assert [e.token_id for e in b.logprobs] == [e.token_id for e in a.logprobs]
                assert [e.top_ids for e in b.logprobs] == [e.top_ids for e in a.logprobs]
                for x, y in zip(a.logprobs, b.logprobs):
                    assert abs(x.logprob - y.logprob) < 1e-4
    engine = spec.engine
    assert engine.scheduler.spec_num_draft_tokens_total > 0
    if name != "draft":  # a random second model rarely agrees with the target
        assert engine.scheduler.spec_num_accepted_tokens_total > 0
    stats = got[0].timings
    assert 0.0 <= stats["spec_acceptance_rate"] <= 1.0 and stats["spec_mean_accepted_len"] >= 1.0
    engine.check_integrity()
    assert engine.kv_cache_usage == 0.0


def test_stop_string_inside_an_accepted_run_cuts_there(models, baseline):
    spec = _llm(models[0], {"method": "ngram", "num_speculative_tokens": 6})
    prompt = [5, 6, 7, 8] * 6  # the tiny model continues this pattern: long accepted runs
    free = baseline.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    a, b = baseline.generate([prompt], params)[0].outputs[0], spec.generate([prompt], params)[0].outputs[0]
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert a.finish_reason == "stop"


def test_sampled_distribution_is_kept(models):
    """Two-sample chi-square on the 2nd and 4th tokens, with and without speculation.

    The draft is the target itself proposing greedily, so drafts are accepted with the
    target's probability of the argmax and rejected often enough to test the residual draw.
    """
    params = [SamplingParams(max_tokens=4, temperature=0.5, seed=i, ignore_eos=True) for i in range(400)]
    prompt = [[5, 6, 7, 8] * 3]
    outs = {}
    for label, spec in (("plain", None), ("spec", {"method": "draft", "model": str(models[0])})):
        llm = _llm(models[0], spec, max_num_seqs=128, num_blocks=1024)
        outs[label] = [o.outputs[0].token_ids for o in llm.generate(prompt * len(params), params)]
        llm.engine.check_integrity()
        if spec:
            assert llm.engine.scheduler.spec_num_draft_tokens_total > 500
            sched = llm.engine.scheduler
            rate = sched.spec_num_accepted_tokens_total / sched.spec_num_draft_tokens_total
            assert 0.01 < rate < 0.99  # both branches of the rejection sampler ran
    for position in (1, 3):
        a = Counter(t[position] for t in outs["plain"])
        b = Counter(t[position] for t in outs["spec"])
        assert _two_sample_chi2_ok(a, b), (position, a.most_common(8), b.most_common(8))


def _two_sample_chi2_ok(a: Counter, b: Counter) -> bool:
    """Chi-square homogeneity test at p > 0.001, rare categories pooled."""
    import math

    n_a, n_b = sum(a.values()), sum(b.values())
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= 10]
    rest = (n_a - sum(a[c] for c in cats), n_b - sum(b[c] for c in cats))
    cells = [(a[c], b[c]) for c in cats] + ([rest] if sum(rest) else [])
    stat = 0.0
    for x, y in cells:
        total = x + y
        for obs, n in ((x, n_a), (y, n_b)):
            exp = total * n / (n_a + n_b)
            stat += (obs - exp) ** 2 / exp
    dof = max(len(cells) - 1, 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2)) > 1e-3


def test_seeded_requests_reproduce_with_speculation(models):
    spec = _llm(models[0], {"method": "ngram", "num_speculative_tokens": 3})
    prompt = [5, 6, 7, 8] * 5
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    alone = spec.generate([prompt], params)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    mixed = spec.generate([[9, 10, 11], prompt, [5, 6, 7]], [noise, params, noise])[1].outputs[0].token_ids
    assert alone == mixed


def test_no_leaks_with_preemption_and_aborts(models):
    """A cache far too small, drafts on every decode, aborts mid-flight: all blocks come back,
    in the target's pool and in the draft's."""
    spec = _llm(
        models[0],
        {"method": "self", "draft_layers": 1, "num_speculative_tokens": 3},
        num_blocks=40,
        max_num_seqs=8,
    )
    engine = spec.engine
    tok = spec.get_tokenizer()
    prompts = [tok.encode(t) for t in TRAIN_TEXT] * 3
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingParams(max_tokens=30 + i, temperature=0.0 if i % 2 else 0.9, ignore_eos=True)
        )
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps in (5, 9):
            for rid in (f"r{steps}", f"r{steps + 1}"):
                engine.abort_request(rid)
        assert steps < 2000
    engine.step()  # the last finished ids reach the proposer with the next schedule
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.spec_num_draft_tokens_total > 0
    assert engine.kv_cache_usage == 0.0
    draft = engine.spec.proposer
    draft.kv.check_integrity()
    assert draft.kv.num_free_blocks == draft.kv.num_blocks and not draft.seqs
    assert all(s.status != RequestStatus.RUNNING for s in engine.scheduler.requests.values())


@pytest.mark.parametrize("name", ["ngram", "self-layers"])
def test_per_request_state_is_the_controllers_and_goes_when_requests_finish(models, name):
    """What the draft budget learns per request lives on the controller while the request
    runs, and goes when it finishes or is aborted: round after round leaves nothing behind."""
    spec = _llm(models[0], _spec_config(name, models[1]))
    engine, prompts = spec.engine, _prompts(spec.get_tokenizer())
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    most = 0
    for round_no in range(3):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_no}-{i}", prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            most = max(most, len(engine.spec.records))
            if steps == 6:
                engine.abort_request(f"{round_no}-1")  # mid-flight, with drafts behind it
        assert set(engine.spec.records) <= {f"{round_no}-1"}  # finished ones are gone at once
        engine.step()  # an aborted request's id reaches the controller with the next schedule
        assert engine.spec.records == {}
    assert most > 0 and engine.scheduler.spec_num_draft_tokens_total > 0


def test_draft_budget_follows_the_targets_weights(models):
    """Quantized small steps: the row limit and the quantized row cost; dense steps (also
    "auto" on a model whose file has no quantized tensors): no limit, the dense row cost."""
    from fornax.config import SMALL_STEP_MAX_ROWS
    from fornax.engine.spec_decode.controller import DENSE_ROW_COST, QUANTIZED_ROW_COST

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    quantized = LLM(
        str(models[0]), speculative_config=spec, quantization="int4", progress=False, num_blocks=64
    )
    assert (quantized.engine.spec.row_limit, quantized.engine.spec.row_cost) == (
        SMALL_STEP_MAX_ROWS,
        QUANTIZED_ROW_COST,
    )
    for q in (None, "auto"):  # a safetensors directory carries float tensors only
        dense = LLM(str(models[0]), speculative_config=spec, quantization=q, progress=False, num_blocks=64)
        assert (dense.engine.spec.row_limit, dense.engine.spec.row_cost) == (0, DENSE_ROW_COST)


def test_self_draft_shares_the_targets_int8_large_forms(models):
    """The self-draft copies the module tree, not the weights: the int8 x int8 forms (which
    hold ctypes kernels and cannot be deep-copied) are the target's own objects."""
    from fornax.layers.linear import Linear
    from fornax.layers.native import load_int8_matmul

    if load_int8_matmul() is None:
        pytest.skip("no AVX-512 VNNI or no C compiler: no int8 x int8 forms")
    spec = {"method": "self", "draft_layers": 1, "num_speculative_tokens": 2}
    llm = _llm(models[0], spec, dtype="bfloat16", large_step_quantization="w8a8")
    target = [m.large for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    draft = [m.large for m in llm.engine.spec.proposer.model.modules() if isinstance(m, Linear)]
    assert all(form is not None for form in target)
    assert {id(f) for f in draft} <= {id(f) for f in target}
    out = llm.generate([[5, 6, 7, 8] * 6], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 16
    llm.engine.check_integrity()
