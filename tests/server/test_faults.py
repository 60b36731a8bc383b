"""Faults through a real server: hostile sampling numbers, one request failing inside the
engine, and the engine loop itself failing.

The server runs make run's flags in a process whose engine has two faults injected before
the CLI starts (BOOTSTRAP): a prompt holding token POISON fails while being detokenized,
and a step scheduling a prompt holding FATAL fails in the model runner (a fault outside any
one request).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support import MAKE_RUN_FLAGS

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
VOCAB = 49152
POISON, FATAL = 49000, 49001
SHUTDOWN_TIMEOUT = 5
BOOTSTRAP = f"""
from fornax.engine.core import EngineCore
from fornax.engine.runner.model_runner import ModelRunner

_detokenize = EngineCore._detokenize
def detokenize(self, req, num_before, result):
    if {POISON} in req.prompt_token_ids and req.num_output_tokens >= 3:
        raise RuntimeError("injected fault in one request")
    return _detokenize(self, req, num_before, result)
EngineCore._detokenize = detokenize

_execute = ModelRunner.execute
def execute(self, sched):
    if any({FATAL} in s.request.prompt_token_ids for s in sched.scheduled):
        raise RuntimeError("injected fault in the engine loop")
    return _execute(self, sched)
ModelRunner.execute = execute
"""
PROMPT = [504, 3458, 282, 253, 1345, 30, 378, 314, 6615, 28]  # any real token ids will do


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(
        [*MAKE_RUN_FLAGS, "--no-access-log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)], bootstrap=BOOTSTRAP
    )


def completion(prompt: list[int], **kw: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


HOSTILE = {
    "temperature 1e-50": {"temperature": 1e-50},
    "repetition_penalty 1e-50": {"repetition_penalty": 1e-50, "temperature": 1.0, "seed": 1},
    "repetition_penalty 1e30": {"repetition_penalty": 1e30},
    "top_p 1e-30": {"top_p": 1e-30, "temperature": 1.0, "seed": 2},
    "logit_bias +100": {"logit_bias": {str(t): 100 for t in range(300)}, "temperature": 0.8, "seed": 3},
    "logit_bias -100": {"logit_bias": {str(t): -100 for t in range(300)}},
    "all penalties": {
        "repetition_penalty": 1e-50,
        "presence_penalty": 2,
        "frequency_penalty": -2,
        "min_p": 1e-45,
        "top_k": 1,
        "temperature": 1e-50,
    },
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sampling_numbers_get_an_answer_or_a_400(server, name: str) -> None:
    body = completion(PROMPT, logprobs=0, **HOSTILE[name])
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    if r.status_code == 400:
        assert_envelope(r, 400)
    else:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 8
    # ... and the server is as good as before.
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json=completion(PROMPT), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_bias_on_every_allowed_token_keeps_ids_in_the_vocabulary(server) -> None:
    # +100 on the last 300 ids of the vocabulary: whatever is drawn must still be a real token.
    bias = {str(t): 100 for t in range(VOCAB - 300, VOCAB)}
    body = completion(PROMPT, logit_bias=bias, temperature=1.0, seed=7, max_tokens=4)
    r = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4


async def _post(client: httpx.AsyncClient, body: dict) -> httpx.Response:
    return await client.post("/v1/completions", json=body)


async def _stream_events(client: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_one_faulty_request_in_a_batch_of_8_ends_alone(server) -> None:
    prompts = [PROMPT[i:] + [300 + i] for i in range(8)]
    poisoned = prompts[5] + [POISON]

    async def scenario() -> tuple[list[httpx.Response], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            bodies = [completion(p, max_tokens=16) for i, p in enumerate(prompts) if i != 5]
            return await asyncio.gather(
                asyncio.gather(*(_post(client, b) for b in bodies), _post(client, completion(poisoned))),
                _stream_events(client, completion(poisoned, max_tokens=16)),
            )

    responses, events = asyncio.run(scenario())
    *normal, failed = responses
    for r in normal:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 16
    error = assert_envelope(failed, 500)
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "injected" not in error["message"]  # the details stay in the server's log
    # The stream ends with an error event, and no chunk claims a finish_reason.
    assert "error" in events[-1] and events[-1]["error"]["code"] == "internal_error"
    assert all(c.get("finish_reason") is None for e in events[:-1] for c in e.get("choices", []))
    assert "injected fault in one request" in server.log()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    server.assert_idle()


def test_a_dead_engine_fails_everyone_turns_health_503_and_exits_non_zero(server) -> None:
    async def scenario() -> tuple[list[httpx.Response], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            long_ones = [_post(client, completion(PROMPT[i:], max_tokens=200)) for i in range(3)]
            stream = _stream_events(client, completion(PROMPT[1:], max_tokens=200))

            async def fatal_later() -> httpx.Response:
                await asyncio.sleep(0.5)  # the others are decoding by then
                return await _post(client, completion(PROMPT + [FATAL]))

            *responses, events = await asyncio.gather(*long_ones, fatal_later(), stream)
            return responses, events

    start = time.monotonic()
    responses, events = asyncio.run(scenario())
    for r in responses:  # every waiter failed at once, none hung
        error = assert_envelope(r, 503)
        assert error["code"] == "engine_dead"
    assert events[-1]["error"]["code"] == "engine_dead"
    # The process stays up for a moment answering 503, so probes see why it goes.
    body = assert_envelope(httpx.get(server.url + "/health", timeout=5), 503)
    assert body["code"] == "engine_dead" and "injected fault in the engine loop" in body["message"]
    server.proc.wait(timeout=SHUTDOWN_TIMEOUT + 5)
    assert server.proc.returncode == 1, server.log()
    assert time.monotonic() - start < 60
