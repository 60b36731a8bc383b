"""32 simultaneous streaming requests through the real server, each equal to its sequential run.

The server runs in fp32 here: bf16 results depend on the batch shape (kernels differ with
the number of rows in a step), so only fp32 makes "batched == alone" an exact property.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow
KEY = "sk-test-concurrency"
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    f"{verb} {topic} in one sentence."
    for verb in ("Describe", "Explain", "Summarize", "Praise")
    for topic in ("the sea", "a compiler", "autumn", "the moon", "bread", "a violin", "rain", "chess")
]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(["--api-key", KEY, "--no-access-log", "--dtype", "float32"], api_key=KEY)


def test_32_concurrent_streams_equal_sequential(server):
    assert len(set(PROMPTS)) == 32
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    params = dict(model=MODEL, max_tokens=12, temperature=0)
    expected = {
        p: client.chat.completions.create(messages=[{"role": "user", "content": p}], **params).choices[0].message.content
        for p in PROMPTS
    }
    assert len(set(expected.values())) > 16  # distinct answers, so swapped streams would show

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, str | None]:
        stream = await aclient.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], stream=True, **params
        )
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return prompt, text, reason

    async def run_all() -> list[tuple[str, str, str | None]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text, reason in results:
        assert reason in ("stop", "length")
        assert text == expected[prompt], prompt
    server.assert_idle()
