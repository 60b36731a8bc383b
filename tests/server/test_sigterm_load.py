"""SIGTERM with 32 streams in flight, through make run's flags: every stream finishes
normally (its finish_reason, its full usage, then `data: [DONE]`), no new request is taken
once the signal is in (503 envelope, or the connection refused once the listener is
closed), and the process exits 0.

Alone on the 2-core machine the streams end ~5 s after the signal; beside other test
servers a step can take ten times as long. If the shutdown timeout passes even so, the
drain aborts what is left: such a stream must still end cleanly (finish_reason "abort",
its usage, `data: [DONE]`), and the server log must show that the timeout was reached.
"""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass

import httpx
import pytest

from tests.support import MAKE_RUN_FLAGS

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
STREAMS = 32
MAX_TOKENS = 128  # at 32 rows per step on 2 CPUs: several seconds of decoding left at the signal
SHUTDOWN_TIMEOUT = 120  # generous: the drain, not the timeout, is what this test is about


@pytest.fixture(scope="module")
def server(make_server):
    return make_server([*MAKE_RUN_FLAGS, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)])


@dataclass
class StreamResult:
    status: int = 0
    tokens_at_signal: int | None = None  # text events seen when SIGTERM was sent
    text_events: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # `data: [DONE]` arrived, and nothing after it
    errors: list[str] | None = None


async def _stream(client: httpx.AsyncClient, i: int, started: asyncio.Event, result: StreamResult) -> None:
    """One streaming request, chat or completions by turn; `started` is set at its first token."""
    chat = i % 2 == 0
    body: dict = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}]
    else:
        body["prompt"] = f"Story {i}: once upon a time"
    result.errors = []
    async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        result.status = r.status_code
        async for line in r.aiter_lines():
            if not line:
                continue
            if result.done:
                result.errors.append(f"after [DONE]: {line}")
            elif line == "data: [DONE]":
                result.done = True
            else:
                _read_event(json.loads(line.removeprefix("data: ")), chat, started, result)


def _read_event(event: dict, chat: bool, started: asyncio.Event, result: StreamResult) -> None:
    if "error" in event:
        result.errors.append(str(event["error"]))
        return
    for c in event["choices"]:
        text = (c["delta"].get("content") or "") if chat else c["text"]
        if text:
            result.text_events += 1
            started.set()
        result.finish_reason = c["finish_reason"] or result.finish_reason
    if event.get("usage"):
        result.completion_tokens = event["usage"]["completion_tokens"]


async def _late_request(url: str) -> str:
    """A new request on a new connection after the signal: how it was turned away."""
    body = {"model": MODEL, "prompt": "too late", "max_tokens": 2}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/v1/completions", json=body)
    except httpx.ConnectError:
        return "refused"
    except (httpx.ReadError, httpx.RemoteProtocolError):
        # Accepted by the socket in the last instant before the server closed it, and closed
        # unanswered: turned away too (never run), a race a loaded machine meets now and then.
        return "refused"
    if r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable":
        return "503"
    return f"accepted? HTTP {r.status_code}: {r.text[:200]}"


async def _drive(server) -> tuple[list[StreamResult], list[str]]:
    results = [StreamResult() for _ in range(STREAMS)]
    started = [asyncio.Event() for _ in range(STREAMS)]
    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=180, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, i, started[i], results[i])) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=180)
        for r in results:
            r.tokens_at_signal = r.text_events
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)  # the signal handler runs in the server's event loop
        late: list[str] = []
        while not all(t.done() for t in tasks):  # new requests, all through the drain
            late.append(await _late_request(server.url))
            await asyncio.sleep(0.25)
        await asyncio.gather(*tasks)
    late.append(await _late_request(server.url))  # and once the streams are done
    return results, late


def test_sigterm_with_32_streams_in_flight_drains_them_all(server):
    results, late = asyncio.run(_drive(server))
    assert server.proc.wait(60) == 0, server.log()
    log = server.log_path.read_text(errors="replace")
    assert f"SIGTERM: draining {STREAMS} request(s)" in log  # all 32 were in flight
    timed_out = "shutdown timeout: aborting" in log
    for i, r in enumerate(results):
        assert r.tokens_at_signal is not None and 0 < r.tokens_at_signal < MAX_TOKENS, (i, r)
        assert r.status == 200 and not r.errors and r.done, (i, r)
        if r.finish_reason == "abort" and timed_out:  # the slow machine's case (see the docstring)
            assert r.completion_tokens is not None and r.completion_tokens < MAX_TOKENS, (i, r)
            continue
        assert r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS, (i, r)
    assert len(late) >= 2 and set(late) <= {"503", "refused"}, late
    assert "503" in late, late  # turned away while the drain ran, not only once it had closed
