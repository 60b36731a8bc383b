"""What live views see of the tiers, and the int8 tier form through the engine (tiny model)."""

from __future__ import annotations

import asyncio

import pytest

from fornax import LLM, SamplingParams
from tests.model.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
DOC = list(range(5, 5 + 50))  # 3 full blocks of 16, and 2 tokens
FILLER = list(range(200, 200 + 100))  # needs 7 of the pool's 8 blocks: evicts the document


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama-tiers")
    build_tiny_model("llama", out)
    return out


def _llm(path, **kw) -> LLM:
    return LLM(str(path), num_blocks=8, block_size=16, progress=False, kv_offload_memory="8MiB", **kw)


def test_blocks_event_names_the_tier_each_block_came_from(tiny_dir):
    llm = _llm(tiny_dir, dtype="float32")
    loop = asyncio.new_event_loop()
    try:
        sub = llm.engine.events.subscribe(loop=loop)
        want = llm.generate([DOC], GREEDY)[0].outputs[0].token_ids
        llm.generate([FILLER], GREEDY)
        again = llm.generate([DOC + [7]], GREEDY)[0]
        loop.run_until_complete(asyncio.sleep(0))
        events = []
        while not sub.queue.empty():
            events.append(sub.queue.get_nowait())
    finally:
        loop.close()
    blocks = [e for e in events if e.type == "blocks" and e.data["cached"]]
    assert blocks, "the third request must find its document in a tier"
    last = blocks[-1].data
    assert set(last["tiers"].values()) == {"host"} and len(last["tiers"]) >= 2
    assert set(last["tiers"]) <= {str(b) for b in last["cached"]}
    assert again.num_cached_tokens == 48
    assert llm.generate([DOC], GREEDY)[0].outputs[0].token_ids == want
    llm.engine.check_integrity()


def test_int8_tier_form_serves_hits_and_swaps(tiny_dir):
    llm = _llm(tiny_dir, dtype="bfloat16", kv_offload_dtype="int8")
    llm.generate([DOC], GREEDY)
    llm.generate([FILLER], GREEDY)
    out = llm.generate([DOC + [9]], GREEDY)[0]
    stats = llm.engine.scheduler.connector.stats()
    assert out.num_cached_tokens == 48 and stats.hit_tokens_host >= 32  # the rest: primary hits
    assert llm.engine.scheduler.connector.layout.quantized
    # Preemption under pressure swaps int8 rows out and back; every request still finishes.
    many = llm.generate(
        [list(range(20 + 7 * i, 40 + 7 * i)) for i in range(5)],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    assert all(len(o.outputs[0].token_ids) == 24 for o in many)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.scheduler.connector.stats().swapped_in > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0
