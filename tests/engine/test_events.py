"""The lifecycle-event bus: what the engine publishes for one request, late replay, idle cost."""

from __future__ import annotations

import asyncio

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.events import Event, EventBus
from tests.model.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama-events")
    build_tiny_model("llama", out)
    # Chunked prefill (16 tokens a step) and prefix caching, so every event type shows up.
    return LLM(
        str(out),
        dtype="float32",
        enable_prefix_caching=True,
        num_blocks=64,
        block_size=16,
        max_num_batched_tokens=16,
        progress=False,
    )


def _drain(loop: asyncio.AbstractEventLoop, sub) -> list[Event]:
    loop.run_until_complete(asyncio.sleep(0))  # run the call_soon_threadsafe deliveries
    events = []
    while not sub.queue.empty():
        events.append(sub.queue.get_nowait())
    return events


def _run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    llm.engine.add_request(request_id, prompt, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_request_lifecycle_events(tiny):
    llm = tiny
    core = llm.engine
    loop = asyncio.new_event_loop()
    try:
        sub = core.events.subscribe(loop=loop)
        assert core.events.active
        prompt = list(range(3, 3 + 40))  # 40 tokens: 3 chunks of <= 16, 2 full blocks
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
        _run(llm, "r1", prompt, params)
        first = _drain(loop, sub)
        types = [e.type for e in first]
        assert types[0] == "queued" and first[0].data["position"] == 0
        assert types[1:3] == ["scheduled", "blocks"]
        chunks = [(e.data["start"], e.data["end"]) for e in first if e.type == "prefill_chunk"]
        assert chunks == [(0, 16), (16, 32), (32, 40)]
        tokens = [e for e in first if e.type == "token"]
        assert len(tokens) == 5 and tokens[0].data["ttft_s"] > 0 and tokens[0].data["itl_s"] is None
        assert all(t.data["itl_s"] > 0 for t in tokens[1:])
        assert all(isinstance(t.data["logprob"], float) for t in tokens)
        assert types[-1] == "finished" and first[-1].data["finish_reason"] == "length"
        assert [e.seq for e in first] == sorted(e.seq for e in first)
        assert not first[2].data["cached"]  # a cold cache

        # The same prompt again: its two full blocks come from the prefix cache.
        _run(llm, "r2", prompt, params)
        second = _drain(loop, sub)
        blocks = next(e for e in second if e.type == "blocks")
        assert len(blocks.data["cached"]) == 2
        assert next(e for e in second if e.type == "scheduled").data["num_cached_tokens"] == 32
        assert [(e.data["start"], e.data["end"]) for e in second if e.type == "prefill_chunk"] == [(32, 40)]

        # A subscriber that comes late replays the request's history, then nothing more.
        late = core.events.subscribe("r2", loop=loop)
        replay = _drain(loop, late)
        assert [e.seq for e in replay] == [e.seq for e in second]
        late.close()
        sub.close()
        assert not core.events.active
        core.check_integrity()
    finally:
        loop.close()


def test_speculative_verification_events(tmp_path):
    """Each verifying step reports its drafts, what was accepted, and the blocks the rollback
    gave back (4-token blocks, so rejected drafts often leave a whole block behind)."""
    build_tiny_model("llama", tmp_path)
    always = {"disable_by_batch_size": 0, "row_cost": 0.0, "draft_cost": 0.0}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, **always}
    llm = LLM(
        str(tmp_path), dtype="float32", num_blocks=128, block_size=4, speculative_config=spec, progress=False
    )
    core = llm.engine
    loop = asyncio.new_event_loop()
    try:
        sub = core.events.subscribe(loop=loop)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        _run(llm, "s1", [5, 6, 7, 5, 6, 7, 5, 6], params)
        events = _drain(loop, sub)
        verifies = [e for e in events if e.type == "spec_verify"]
        assert verifies, "the n-gram proposer drafted nothing"
        for e in verifies:
            assert 0 <= e.data["num_accepted_tokens"] <= e.data["num_draft_tokens"] <= 3
        finished = next(e for e in events if e.type == "finished")
        timings = finished.data["timings"]
        assert sum(e.data["num_draft_tokens"] for e in verifies) == timings["spec_num_draft_tokens"]
        assert sum(e.data["num_accepted_tokens"] for e in verifies) == timings["spec_num_accepted_tokens"]
        released = [b for e in verifies for b in e.data["released_blocks"]]
        assert released, "no rollback released a block"
        # Every released block had been reported to the view as one of the request's.
        reported = {b for e in events if e.type == "blocks" for b in e.data["table"]}
        assert set(released) <= reported
        sub.close()
        core.check_integrity()
        assert core.kv_cache_usage == 0.0
    finally:
        loop.close()


def test_idle_bus_builds_nothing(tiny):
    """With no subscriber the tap is never called and no history is kept."""
    core = tiny.engine
    assert not core.events.active
    before = core.events.num_published
    _run(tiny, "quiet", list(range(5, 25)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert core.events.num_published == before
    assert core.events.history("quiet") == []


def test_slow_subscriber_drops_oldest_and_never_blocks():
    bus = EventBus()
    loop = asyncio.new_event_loop()
    try:
        sub = bus.subscribe(maxsize=4, loop=loop)
        bus.publish([Event("token", "x", 0.0, {"i": i}) for i in range(10)])
        got = _drain(loop, sub)
        assert [e.data["i"] for e in got] == [6, 7, 8, 9] and sub.dropped == 6
        sub.close()
        assert not bus.active and bus.history("x") == []
    finally:
        loop.close()
