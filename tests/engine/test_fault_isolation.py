"""Faults inside the engine: one request's fault ends that request alone; an observer's
fault detaches the observer; a fault of the loop itself fails every waiter at once.

fp32 so that the batch losing a row cannot flip a greedy near-tie in the others.
"""

from __future__ import annotations

import asyncio

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from tests.engine import prompt_ids

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(
        str(default_gguf),
        dtype="float32",
        enable_prefix_caching=False,
        kv_cache_memory="128MiB",
        progress=False,
    )


def _prompts(llm: LLM) -> list[list[int]]:
    return [prompt_ids(llm.engine.tokenizer, 20 + 3 * i, offset=41 * i) for i in range(8)]


def _fail_after(calls: int):
    """A detokenizer update that works `calls` times, then raises."""
    count = 0

    def update(token_ids: list[int]) -> None:
        nonlocal count
        count += 1
        if count > calls:
            raise RuntimeError("injected detokenizer fault")

    return update


def test_a_faulty_request_ends_alone(llm: LLM) -> None:
    prompts = _prompts(llm)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    core = llm.engine
    for i, ids in enumerate(prompts):
        core.add_request(f"f{i}", ids, GREEDY)
    core.seqs["f3"].detok.update = _fail_after(4)  # the fourth request fails on its fifth token
    tokens: dict[str, list[int]] = {f"f{i}": [] for i in range(8)}
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    assert finals["f3"].error is not None and "injected" in finals["f3"].error
    assert finals["f3"].finish_reason == "abort"
    for i in range(8):
        if i != 3:
            assert finals[f"f{i}"].error is None
            assert tokens[f"f{i}"] == expected[i], f"request {i} changed"
    core.check_integrity()
    assert core.kv_cache_usage == 0.0


def test_a_failing_event_tap_is_detached(llm: LLM) -> None:
    core = llm.engine
    loop = asyncio.new_event_loop()
    subscription = core.events.subscribe(loop=loop)
    try:

        def broken(*args: object) -> None:
            raise RuntimeError("injected tap fault")

        core.event_tap.on_outputs = broken
        out = llm.generate([_prompts(llm)[0]], GREEDY)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert core.event_tap is None
    finally:
        core.events.unsubscribe(subscription)
        loop.close()


def _run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_a_failing_step_listener_is_detached(llm: LLM) -> None:
    async def scenario() -> list[int]:
        engine = AsyncEngine(llm.engine)
        calls = []

        def broken(stats: object) -> None:
            calls.append(1)
            raise RuntimeError("injected listener fault")

        engine.listeners.append(broken)
        engine.start()
        try:
            tokens = []
            async for out in engine.generate("l0", _prompts(llm)[1], GREEDY):
                tokens += out.new_token_ids
        finally:
            engine.stop()
        assert calls == [1] and broken not in engine.listeners
        return tokens

    assert len(_run_async(scenario())) == GREEDY.max_tokens


def test_a_dead_engine_fails_every_waiter_at_once(default_gguf) -> None:
    llm = LLM(str(default_gguf), dtype="float32", kv_cache_memory="64MiB", progress=False)
    core = llm.engine
    real_execute = core.runner.execute
    steps = 0

    def execute(sched):
        nonlocal steps
        steps += 1
        if steps > 3:
            raise RuntimeError("injected engine fault")
        return real_execute(sched)

    core.runner.execute = execute

    async def scenario() -> None:
        engine = AsyncEngine(core)
        died = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine.on_dead = lambda exc: loop.call_soon_threadsafe(died.set)
        engine.start()

        async def consume(i: int) -> BaseException | None:
            try:
                async for _ in engine.generate(f"d{i}", _prompts(llm)[i], SamplingParams(max_tokens=50)):
                    pass
            except BaseException as exc:
                return exc
            return None

        results = await asyncio.gather(*(consume(i) for i in range(4)))
        assert all(isinstance(r, EngineDeadError) for r in results), results
        await asyncio.wait_for(died.wait(), timeout=5)
        with pytest.raises(EngineDeadError):  # no command waits for a thread that is gone
            await asyncio.wait_for(engine.call(lambda c: None), timeout=5)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("late", [1, 2, 3], GREEDY):
                pass
        engine.stop()

    _run_async(scenario())


def test_request_failed_error_is_raised_to_the_consumer(llm: LLM) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            gen = engine.generate("x0", _prompts(llm)[2], GREEDY)
            first = await gen.__anext__()  # the request is in the engine now
            assert first.error is None
            await engine.call(lambda core: setattr(core.seqs["x0"].detok, "update", _fail_after(0)))
            with pytest.raises(RequestFailedError, match="injected"):
                async for _ in gen:
                    pass
            assert await engine.call(lambda core: core.kv_cache_usage) == 0.0
        finally:
            engine.stop()

    _run_async(scenario())
