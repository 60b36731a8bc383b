"""A caller cancelled while its request is being submitted (a client that disconnects at
once) leaves the engine serving, and leaves no request running and no KV block held.

asyncio.wrap_future passes a task's cancellation on to the engine command's future; the
engine thread used to set that future's result anyway, and InvalidStateError stopped the
engine loop for every request (found by benchmarks/soak.py).
"""

from __future__ import annotations

import asyncio

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.async_engine import AsyncEngine
from tests.engine import prompt_ids

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(str(default_gguf), enable_prefix_caching=False, kv_cache_memory="128MiB", progress=False)


async def _consume(engine: AsyncEngine, request_id: str, ids: list[int]) -> int:
    count = 0
    async for out in engine.generate(request_id, ids, PARAMS):
        count += len(out.new_token_ids)
    return count


async def _idle(engine: AsyncEngine) -> tuple[bool, float]:
    """(has unfinished requests, KV usage) once the aborts have run; integrity checked."""
    for _ in range(200):
        busy = await engine.call(lambda core: core.has_unfinished_requests())
        if not busy:
            break
        await asyncio.sleep(0.01)

    def read(core) -> tuple[bool, float]:
        core.check_integrity()
        return core.has_unfinished_requests(), core.kv_cache_usage

    return await engine.call(read)


def test_cancel_during_submission_keeps_the_engine_serving(llm: LLM) -> None:
    ids = prompt_ids(llm.engine.tokenizer, 24)

    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            # Cancel at varied moments around the engine thread's handling of the add:
            # before it is taken, while it runs, just after.
            for round_ in range(30):
                tasks = [asyncio.create_task(_consume(engine, f"c{round_}-{i}", ids)) for i in range(8)]
                await asyncio.sleep(0 if round_ % 3 == 0 else 0.0005 * (round_ % 5))
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                assert engine.dead_error is None, engine.dead_error
            assert await _consume(engine, "after", ids) == PARAMS.max_tokens
            assert await _idle(engine) == (False, 0.0)
            assert engine.num_unfinished == 0
        finally:
            engine.stop()

    asyncio.run(run())
