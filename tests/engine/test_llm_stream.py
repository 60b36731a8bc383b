"""LLM.stream yields one request's outputs only, all n of its samples, and an iterator closed
early aborts its request: the engine keeps nothing of it."""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams
from tests.model.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", out)
    return LLM(str(out), dtype="float32", kv_cache_memory="16MiB", progress=False)


def test_a_stream_yields_only_its_own_request(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("someone-else", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    outs = list(llm.stream([1, 2, 3, 4], params))
    assert {o.request_id for o in outs} == {outs[0].request_id} != {"someone-else"}
    assert sum(len(o.new_token_ids) for o in outs) == 6 and outs[-1].finished
    alone = llm.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids  # the other one runs along
    assert [t for o in outs for t in o.new_token_ids] == alone
    llm.engine.abort_request("someone-else")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.check_integrity()


def test_a_stream_waits_for_all_n_samples(llm):
    outs = list(
        llm.stream([1, 2, 3], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True))
    )
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert not llm.engine.has_unfinished_requests()


def test_closing_a_stream_early_aborts_its_request(llm):
    stream = llm.stream([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_kv_blocks == 0
    llm.engine.check_integrity()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # nothing lingers
