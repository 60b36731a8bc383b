"""The router over stub replicas (tests/router/stub.py) whose failures each test chooses:
failover before the commit point, clean stream errors after it, passive ejection and
re-admission, 4xx/429/503 handling, model routing, auth, membership, metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from fornax.router.app import create_app
from fornax.router.config import DnsSpec, ReplicaSpec, RouterConfig
from fornax.router.core import Router
from tests.router.stub import MODEL, StubReplica, ThreadServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def shared_stubs() -> Iterator[tuple[StubReplica, StubReplica]]:
    a, b = StubReplica("a").start(), StubReplica("b").start()
    yield a, b
    a.server.stop()
    b.server.stop()


@pytest.fixture
def stubs(shared_stubs: tuple[StubReplica, StubReplica]) -> tuple[StubReplica, StubReplica]:
    """Two stubs, healthy and answering (shared by the tests, reset for each)."""
    for stub in shared_stubs:
        stub.reset()
    return shared_stubs


@pytest.fixture
def own_stubs() -> Iterator[tuple[StubReplica, StubReplica]]:
    """Two stubs of the test's own, which it may stop."""
    a, b = StubReplica("a").start(), StubReplica("b").start()
    yield a, b
    a.server.stop()
    b.server.stop()


@contextmanager
def router(urls: list[str], **kw: object) -> Iterator[tuple[str, Router]]:
    settings: dict[str, object] = {
        "policy": "round-robin",
        "poll_interval_s": 0.1,
        "backoff_base_s": 0.001,
        "backoff_max_s": 0.01,
        "access_log": False,
    } | kw
    config = RouterConfig(replicas=tuple(ReplicaSpec(u) for u in urls), **settings)
    app = create_app(config)
    server = ThreadServer(app).start()
    try:
        yield server.url, app.state.router
    finally:
        server.stop()


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def events(r: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in r.text.split("\n\n") if line.startswith("data: ")]


def stream(url: str, body: dict, **kw: object) -> tuple[httpx.Response, list[tuple[float, str]]]:
    """POST a streaming request; (response, [(arrival time, event data)])."""
    out: list[tuple[float, str]] = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10, **kw
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append((time.monotonic(), line[len("data: ") :]))
    return r, out


def test_plain_request_and_headers(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    with router([a.url, b.url]) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["replica"] == "a"
        assert r.headers["x-fornax-replica"] == a.url and r.headers["x-fornax-route-reason"] == "round_robin"
        assert r.headers["x-fornax-attempts"] == "1"
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).json()["replica"] == "b"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL
        assert httpx.get(url + "/health").json()["healthy_replicas"] == 2
        metrics = httpx.get(url + "/metrics").text
        for line in (
            'fornax_router:routing_decisions_total{policy="round-robin",reason="round_robin"} 2.0',
            'fornax_router:e2e_request_latency_seconds_count{endpoint="chat"} 2.0',
            f'fornax_router:requests_total{{outcome="ok",replica="{a.url}"}} 1.0',
            "fornax_router:healthy_replicas 2.0",
            f'fornax_router:replica_inflight{{replica="{b.url}"}} 0.0',
        ):
            assert line in metrics, line


def test_replicas_from_dns(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, _ = stubs
    with router([], replica_dns=(DnsSpec("localhost", a.server.port),)) as (url, rt):
        local = f"http://127.0.0.1:{a.server.port}"
        wait_for(lambda: rt.replicas.get(local) is not None and rt.replicas.get(local).available)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.json()["replica"] == "a" and r.headers["x-fornax-replica"] == local
        assert {x.source for x in rt.replicas} == {f"dns:localhost:{a.server.port}"}


def test_5xx_fails_over_and_ejects_then_health_checks_readmit(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = "status:500"
    with router([a.url, b.url], poll_interval_s=0.4) as (url, rt):  # /health says 200 all along
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["replica"] == "b" and r.headers["x-fornax-attempts"] == "2"
        ra = rt.replicas.get(a.url)
        assert ra is not None and not ra.health.healthy and ra.health.ejections == 1
        for _ in range(3):  # out of rotation: nothing more goes to a
            assert httpx.post(url + "/v1/chat/completions", json=CHAT).json()["replica"] == "b"
        assert len(a.requests) == 1
        a.mode = "ok"
        wait_for(lambda: ra.health.healthy)  # /health kept answering 200: two good checks
        seen = {httpx.post(url + "/v1/chat/completions", json=CHAT).json()["replica"] for _ in range(2)}
        assert seen == {"a", "b"}
        metrics = httpx.get(url + "/metrics").text
        assert f'fornax_router:ejections_total{{kind="passive",replica="{a.url}"}} 1.0' in metrics
        assert 'fornax_router:retries_total{reason="server_error"} 1.0' in metrics


def test_4xx_passes_through_and_never_counts(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = b.mode = "status:400"
    with router([a.url, b.url]) as (url, rt):
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 400 and r.headers["x-fornax-attempts"] == "1"
            assert r.json()["error"]["message"] in ("a says 400", "b says 400")
        assert all(rep.health.healthy and rep.health.ejections == 0 for rep in rt.replicas)


def test_503_is_not_ready_not_a_fault(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    with router([a.url, b.url], poll_interval_s=0.05) as (url, rt):
        ra = rt.replicas.get(a.url)
        assert ra is not None and ra.available
        a.mode, a.health_status = "status:503", 503  # draining: /health says so too
        wait_for(lambda: not ra.ready)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.json()["replica"] == "b"
        time.sleep(0.3)  # several 503 health checks: still no fault counted
        assert ra.health.healthy and ra.health.ejections == 0 and ra.health.failures == 0
        a.mode, a.health_status = "ok", 200
        wait_for(lambda: ra.available)


def test_429_everywhere_passes_the_last_one(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = b.mode = "status:429"
    with router([a.url, b.url], max_attempts=3) as (url, rt):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert (
            r.status_code == 429 and r.headers["retry-after"] == "7" and r.headers["x-fornax-attempts"] == "3"
        )
        assert len(a.requests) + len(b.requests) == 3 and len(a.requests) >= 1 and len(b.requests) >= 1
        assert all(rep.health.healthy for rep in rt.replicas)
        b.mode = "ok"
        r = httpx.post(
            url + "/v1/chat/completions", json=CHAT
        )  # a 429s, b answers: the client never sees a 429
        assert r.status_code == 200 and r.json()["replica"] == "b"


def test_connection_refused_fails_over(own_stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = own_stubs
    with router([a.url, b.url], poll_interval_s=5.0) as (url, rt):  # slow polls: the request finds out first
        a.server.stop()
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["replica"] == "b" and r.headers["x-fornax-attempts"] == "2"
        ra = rt.replicas.get(a.url)
        assert ra is not None and not ra.health.healthy and "ClientConnectorError" in (ra.last_error or "")


def test_all_replicas_down_is_502_then_503(own_stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = own_stubs
    with router([a.url, b.url], poll_interval_s=5.0) as (url, _):
        a.server.stop()
        b.server.stop()
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_unavailable"
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)  # both ejected now
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert httpx.get(url + "/health").status_code == 503


def test_stream_failure_before_first_content_fails_over(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = "die_after:0"  # sends the role chunk, then dies
    with router([a.url, b.url]) as (url, _):
        r, got = stream(url, CHAT)
        data = [d for _, d in got]
        assert r.headers["x-fornax-replica"] == b.url and r.headers["x-fornax-attempts"] == "2"
        assert data[-1] == "[DONE]" and sum('"role"' in d for d in data) == 1
        assert (
            "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1])
            == "b-0 b-1 b-2 b-3 "
        )


def test_in_band_engine_error_before_content_fails_over(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = "error_event:service_unavailable"
    with router([a.url, b.url], poll_interval_s=5.0) as (url, rt):
        r, got = stream(url, CHAT)
        assert r.headers["x-fornax-replica"] == b.url and got[-1][1] == "[DONE]"
        ra = rt.replicas.get(a.url)
        assert ra is not None and not ra.ready and ra.health.ejections == 0


def test_stream_failure_after_content_ends_cleanly(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.mode = "die_after:2"  # two content chunks, half an event, then the connection drops
    with router([a.url, b.url]) as (url, rt):
        r, got = stream(url, CHAT)
        data = [d for _, d in got]
        assert r.status_code == 200 and r.headers["x-fornax-replica"] == a.url
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "replica_failed"
        chunks = [json.loads(d) for d in data[:-2]]
        assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "a-0 ", "a-1 "]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # the half event was dropped
        ra = rt.replicas.get(a.url)
        assert ra is not None and not ra.health.healthy
        wait_for(lambda: ra.inflight == 0)
        assert 'outcome="stream_error"' in httpx.get(url + "/metrics").text


def test_streams_are_relayed_as_they_come(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.delay = 0.25
    with router([a.url, b.url]) as (url, _):
        _, got = stream(url, CHAT)
        contents = [t for t, d in got if '"content": "a-' in d]
        assert len(contents) == 4
        assert contents[-1] - contents[0] > 0.5  # the first arrived long before the last was produced


def test_one_kept_alive_connection_serves_sequential_requests(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, _ = stubs
    with router([a.url]) as (url, _):
        for i in range(6):
            if i % 2:
                stream(url, CHAT)
            else:
                httpx.post(url + "/v1/chat/completions", json=CHAT)
    assert len(a.peers) == 6 and len(set(a.peers)) == 1  # streams are read to their end, then reused


def test_client_leaving_closes_the_upstream(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.delay = b.delay = 0.5
    with router([a.url, b.url]) as (url, rt):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            next(r.iter_lines())
        with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up at 0.3 s
            httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=0.3)
        wait_for(lambda: all(rep.inflight == 0 for rep in rt.replicas), timeout=1.5)  # before the 2 s answers


def test_model_routing_and_union(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.models, b.models = ("m1",), ("m2", "m3")
    with router([a.url, b.url]) as (url, _):
        for _ in range(3):
            r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "m3"})
            assert r.json()["replica"] == "b"
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        assert sorted(m["id"] for m in httpx.get(url + "/v1/models").json()["data"]) == ["m1", "m2", "m3"]


def test_auth_and_membership_routes(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
    # poll_interval_s=10: no poll round during the test; b's admission comes from the POST itself
    with router(
        [a.url],
        api_keys=(("u", "user-key"),),
        admin_keys=(("ops", "admin-key"),),
        replica_api_key="replica-key",
        poll_interval_s=10.0,
    ) as (url, rt):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            httpx.post(
                url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer no"}
            ).status_code
            == 401
        )
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=user)
        assert (
            r.status_code == 200 and r.json()["auth"] == "Bearer replica-key"
        )  # the replica key, not the user's
        assert httpx.get(url + "/health").status_code == 200  # public
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/router/replicas", headers=user).status_code == 403
        r = httpx.post(url + "/router/replicas", json={"url": b.url, "tags": {"tag": "long"}}, headers=admin)
        # answered after b's first health check: in rotation already, no poll tick to wait out
        assert r.status_code == 201 and r.json()["tags"] == {"tag": "long"} and r.json()["healthy"], r.json()
        listed = httpx.get(url + "/router/replicas", headers=admin).json()
        assert [x["url"] for x in listed["data"]] == [a.url, b.url]
        assert all(x["healthy"] for x in listed["data"])
        assert {
            httpx.post(url + "/v1/chat/completions", json=CHAT, headers=user).json()["replica"]
            for _ in range(2)
        } == {"a", "b"}
        r = httpx.request("DELETE", url + "/router/replicas", json={"url": a.url}, headers=admin)
        assert r.status_code == 200 and rt.replicas.urls() == [b.url]
        assert (
            httpx.request("DELETE", url + "/router/replicas", json={"url": a.url}, headers=admin).status_code
            == 404
        )
        assert httpx.post(url + "/router/replicas", json={"url": "nope"}, headers=admin).status_code == 400


def test_client_authorization_passes_without_a_replica_key(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, _ = stubs
    with router([a.url]) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer tenant-1"})
        assert r.json()["auth"] == "Bearer tenant-1"


@pytest.mark.parametrize("replica_key", [None, "relay-key"])
def test_polls_carry_the_poll_key_and_relayed_requests_do_not(
    own_stubs: tuple[StubReplica, StubReplica], replica_key: str | None
) -> None:
    """--replica-poll-key is for the router's own polls only: relayed requests keep the
    client's Authorization (or get --replica-api-key, when that is given too). Stubs of its own:
    a shared one may still get a poll (no key) from the previous test's router as it stops."""
    a, _ = own_stubs
    with router([a.url], replica_poll_key="poll-key", replica_api_key=replica_key) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer tenant-1"})
        assert r.json()["auth"] == ("Bearer tenant-1" if replica_key is None else f"Bearer {replica_key}")
        wait_for(lambda: a.poll_auth.keys() >= {"/health", "/metrics", "/v1/models"})
    assert a.poll_auth == {path: {"Bearer poll-key"} for path in ("/health", "/metrics", "/v1/models")}


def test_polls_fall_back_to_the_replica_key(own_stubs: tuple[StubReplica, StubReplica]) -> None:
    a, _ = own_stubs
    with router([a.url], replica_api_key="relay-key") as (url, _):
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).json()["auth"] == "Bearer relay-key"
    assert a.poll_auth == {path: {"Bearer relay-key"} for path in ("/health", "/metrics", "/v1/models")}


def test_removed_replica_drains(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    a.delay = 0.2
    with router([a.url, b.url]) as (url, rt):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert rt.replicas.remove(a.url)
            assert httpx.get(url + "/router/replicas").json()["draining"][0]["url"] == a.url
            for _ in range(3):
                assert httpx.post(url + "/v1/chat/completions", json=CHAT).json()["replica"] == "b"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "stop"' in rest[-2]  # it finished on a
        assert httpx.get(url + "/router/replicas").json()["draining"] == []


def test_in_process_membership_from_another_thread(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    with router([a.url], poll_interval_s=10.0) as (
        _url,
        rt,
    ):  # no poll round will come: the add polls at once
        import threading

        t = threading.Thread(target=rt.replicas.add, args=(b.url,), kwargs={"tags": {"zone": "x"}})
        t.start()
        t.join()
        wait_for(lambda: rt.replicas.get(b.url).available, timeout=3)


def test_body_limit_and_bad_json(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, _ = stubs
    with router([a.url], max_body_bytes=1000) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "pad": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(
            url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code in (400, 422)  # the replica's answer, relayed (the stub is FastAPI)
        assert r.headers["x-fornax-replica"] == a.url


def test_stored_responses_are_found_on_the_replica_that_holds_them(
    stubs: tuple[StubReplica, StubReplica],
) -> None:
    a, b = stubs
    with router([a.url, b.url]) as (url, _):
        first = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Hi"}, timeout=10).json()
        holder, other = (a, b) if first["replica"] == "a" else (b, a)
        for _ in range(3):  # round-robin would send every other one elsewhere
            body = {"model": MODEL, "input": "And?", "previous_response_id": first["id"]}
            turn = httpx.post(url + "/v1/responses", json=body, timeout=10)
            assert turn.status_code == 200 and turn.json()["replica"] == holder.name
        got = httpx.get(url + f"/v1/responses/{first['id']}", timeout=10)
        assert got.status_code == 200 and got.json()["replica"] == holder.name
        assert httpx.delete(url + f"/v1/responses/{first['id']}", timeout=10).json()["deleted"] is True
        missing = httpx.get(url + f"/v1/responses/{first['id']}", timeout=10)
        assert (
            missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        )  # both were asked
        assert [r for r in other.requests if r.get("method") == "GET"] and not other.stored
        lost = httpx.post(
            url + "/v1/responses",
            json={"model": MODEL, "input": "x", "previous_response_id": "nope"},
            timeout=10,
        )
        assert lost.status_code == 404 and lost.headers["x-fornax-attempts"] == "2"
        for stub in stubs:
            assert stub.health_status == 200 and stub.mode == "ok"  # a 404 ejects nobody


def test_anthropic_clients_key_header_is_a_key(stubs: tuple[StubReplica, StubReplica]) -> None:
    a, b = stubs
    with router([a.url, b.url], api_keys=(("alice", "sk-a"),)) as (url, _):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        assert (
            httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": "sk-a"}).status_code
            == 200
        )
        assert (
            httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": "sk-b"}).status_code
            == 401
        )
