"""`fornax router` in front of two real `fornax serve` replicas: the official client through
it, errors, cache-aware stickiness with real prefix-cache hits, and failover when a
replica is SIGKILLed with 16 requests queued or running, then restarted on its port.

Replicas run on one thread each with a small context, so two fit on two shared cores.
The failover test runs last: it kills a replica.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks._servers import FornaxProcess
from fornax.router.app import create_app
from fornax.router.config import ReplicaSpec, RouterConfig
from tests.router.stub import ThreadServer
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
REPLICA_ARGS = ["--num-threads", "1", "--max-model-len", "512", "--max-num-seqs", "4", "--no-access-log"]
ROUTER_KEY, ADMIN_KEY = "sk-router", "sk-router-admin"
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.a = ServerProcess(REPLICA_ARGS, tmp / "a.log")
        self.b = ServerProcess(REPLICA_ARGS, tmp / "b.log")
        # The CLI entry point, as a user runs it (round-robin: the failover test knows who gets what).
        args = [
            "router",
            "--replica",
            self.a.url,
            "--replica",
            self.b.url,
            "--policy",
            "round-robin",
            "--poll-interval",
            "0.25",
            "--no-access-log",
            "--api-key",
            ROUTER_KEY,
            "--admin-key",
            f"ops:{ADMIN_KEY}",
        ]
        self.router = FornaxProcess("fornax router", args, tmp / "router.log")
        self.url = self.router.url
        self.restarted: ServerProcess | None = None

    def wait(self) -> None:
        self.a.wait_ready()
        self.b.wait_ready()
        self.router.wait_ready(lambda r: r.status_code == 200 and r.json().get("healthy_replicas") == 2, 60)

    def replicas(self) -> dict[str, dict]:
        r = httpx.get(self.url + "/router/replicas", headers=ADMIN)
        r.raise_for_status()
        return {x["url"]: x for x in r.json()["data"]}

    def stop(self) -> None:
        self.router.stop(timeout_s=15)
        for server in (self.a, self.b, self.restarted):
            if server is not None and server.proc.poll() is None:
                server.assert_idle()  # nothing the router started or abandoned is left running
            if server is not None:
                server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("router"))
    try:
        fleet.wait()
        yield fleet
    finally:
        fleet.stop()


def test_openai_client_through_the_router(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
    )
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert text.choices[0].text and text.usage.completion_tokens <= 8
    # Streaming: the first token arrives long before the last one is produced.
    arrivals: list[float] = []
    pieces: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=48,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "length" and len(arrivals) >= 10 and "".join(pieces)
    assert arrivals[-1] - arrivals[0] > 0.3
    tokens = httpx.post(fleet.url + "/tokenize", json={"prompt": "hello world"}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    detok = httpx.post(fleet.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert detok["prompt"].endswith("hello world")


def test_responses_and_messages_through_the_router(fleet: Fleet) -> None:
    import anthropic

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    first = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0)
    # Round-robin sends the next turn to the other replica first: it has no such response, so
    # the router asks on until the replica that stored it answers.
    for _ in range(2):
        turn = client.responses.create(
            model=MODEL, input="Another?", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
        assert turn.previous_response_id == first.id and turn.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id
    with client.responses.stream(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0) as s:
        events = list(s)
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text
    claude = anthropic.Anthropic(base_url=fleet.url, api_key=ROUTER_KEY, max_retries=0)  # x-api-key
    whole = claude.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
    )
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    with pytest.raises(anthropic.AuthenticationError) as err:  # the router's own 401, in Anthropic's envelope
        anthropic.Anthropic(base_url=fleet.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert err.value.body["error"]["type"] == "authentication_error"
    assert all(r["healthy"] and r["ejections"] == 0 for r in fleet.replicas().values())


def test_errors(fleet: Fleet) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert err.value.code == "model_not_found"
    # A 400 is the replica's, passed on unchanged (and it does not count against the replica).
    bad = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": -3}
    direct = httpx.post(fleet.a.url + "/v1/completions", json=bad)
    routed = httpx.post(fleet.url + "/v1/completions", json=bad, headers=AUTH)
    assert routed.status_code == direct.status_code == 400 and routed.json() == direct.json()
    assert all(r["healthy"] and r["ejections"] == 0 for r in fleet.replicas().values())


def test_cache_aware_routing_sticks_to_the_replica_holding_the_prefix(fleet: Fleet) -> None:
    config = RouterConfig(
        replicas=(ReplicaSpec(fleet.a.url), ReplicaSpec(fleet.b.url)),
        policy="cache-aware",
        poll_interval_s=0.25,
        access_log=False,
    )
    server = ThreadServer(create_app(config)).start()
    try:
        prefixes = [
            f"You are assistant number {i}. " + "Answer briefly and politely, citing facts. " * 14
            for i in range(3)
        ]
        seen: dict[int, list[tuple[str, str, int]]] = {i: [] for i in range(3)}
        for round_ in range(3):
            for i, system in enumerate(prefixes):
                body = {
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {round_}?"},
                    ],
                }
                r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                seen[i].append((r.headers["x-fornax-replica"], r.headers["x-fornax-route-reason"], cached))
        for _, visits in seen.items():
            assert len({replica for replica, _, _ in visits}) == 1, visits  # each prefix sticks
            assert [reason for _, reason, _ in visits] == ["cache_miss", "cache_hit", "cache_hit"], visits
            assert all(cached >= 64 for _, _, cached in visits[1:]), visits  # real KV-cache hits
        assert len({visits[0][0] for visits in seen.values()}) == 2  # different prefixes spread
    finally:
        server.stop()


async def _one(client: httpx.AsyncClient, url: str, i: int, started: dict[int, str]) -> dict:
    """Request i: a streaming chat (i % 4 < 2) or a plain completion, 64 tokens."""
    if i % 4 < 2:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Tell story {i}"}],
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        }
        out: dict = {"i": i, "stream": True, "events": []}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get("x-fornax-replica")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    if '"content":"' in line and '"content":""' not in line:
                        started.setdefault(i, out["replica"])
        return out
    body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 64, "ignore_eos": True}
    r = await client.post(url + "/v1/completions", json=body)
    return {
        "i": i,
        "stream": False,
        "status": r.status_code,
        "replica": r.headers.get("x-fornax-replica"),
        "body": r.json(),
    }


async def _burst_and_kill(fleet: Fleet) -> tuple[list[dict], dict[int, str]]:
    """16 requests at once; SIGKILL replica a once one of its streams has content."""
    started: dict[int, str] = {}
    async with httpx.AsyncClient(headers=AUTH, timeout=120) as client:
        tasks = [asyncio.create_task(_one(client, fleet.url, i, started)) for i in range(16)]
        deadline = time.monotonic() + 60
        while fleet.a.url not in started.values():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        fleet.a.proc.send_signal(signal.SIGKILL)
        results = list(await asyncio.gather(*tasks))
        return results, started  # started: which replica each stream first had content from


def test_failover_when_a_replica_dies_and_rejoins(fleet: Fleet) -> None:
    results, started = asyncio.run(_burst_and_kill(fleet))
    assert len(results) == 16 and all(r["status"] == 200 for r in results)
    broken = 0
    for r in results:
        if not r["stream"]:  # answered in full, wherever it ended up
            assert r["body"]["choices"][0]["finish_reason"] == "length", r
            continue
        events = r["events"]
        assert events[-1] == "[DONE]", r
        chunks = [json.loads(e) for e in events[:-1]]
        if any(c.get("choices") and c["choices"][0]["finish_reason"] for c in chunks):
            assert not any("error" in c for c in chunks), r
            continue
        # Unfinished: only a stream that had content from a when a died; it ends with an
        # error event and [DONE], and no chunk claims a finish_reason.
        broken += 1
        assert r["replica"] == fleet.a.url and started.get(r["i"]) == fleet.a.url, r
        assert chunks[-1]["error"]["code"] == "replica_failed", r
    assert broken >= 1
    completed_on_b = [r for r in results if r["replica"] == fleet.b.url]
    assert len(completed_on_b) > 8  # a's queued and non-streaming requests moved to b
    state = fleet.replicas()
    assert not state[fleet.a.url]["healthy"] and state[fleet.a.url]["ejections"] >= 1
    for _ in range(4):  # nothing more goes to the dead replica
        r = httpx.post(
            fleet.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=AUTH
        )
        assert r.status_code == 200 and r.headers["x-fornax-replica"] == fleet.b.url
    # Restarted on the same port, it rejoins after its health checks and gets requests again.
    fleet.restarted = ServerProcess(REPLICA_ARGS, fleet.tmp / "a2.log", port=fleet.a.port)
    fleet.restarted.wait_ready()
    deadline = time.monotonic() + 10
    while not fleet.replicas()[fleet.a.url]["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    seen = set()
    for _ in range(4):
        r = httpx.post(
            fleet.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=AUTH
        )
        seen.add(r.headers["x-fornax-replica"])
    assert seen == {fleet.a.url, fleet.b.url}
    metrics = httpx.get(fleet.url + "/metrics", headers=AUTH).text
    assert "fornax_router:retries_total" in metrics and 'outcome="stream_error"' in metrics
