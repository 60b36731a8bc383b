"""Tenants on a real server: roles, who sees whose requests in the visualizer's streams, the
prefix cache per key (and shared), and per-key rate limits. One server per cache scope."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "dave": "sk-dave", "ops": "sk-ops"}
LIMITS = {"carol": {"requests_per_minute": 2}, "dave": {"tokens_per_minute": 200}}
EOS = "2"  # the model's <|im_end|>: a huge logit bias on it ends a request at its first token
# Long enough for several full 16-token blocks; each test uses its own, so caches start cold.
PROMPT = (
    "In a quiet harbour town, the lighthouse keeper kept a notebook of every ship that passed: "
    "its name, its flag, the hour, the weather, and whether it answered his lamp. On stormy nights "
    "he wrote by candlelight, and in the morning he copied the pages again in a cleaner hand."
)


def key_args(*names: str) -> list[str]:
    args = []
    for name in names:
        args += ["--admin-key" if name == "ops" else "--api-key", f"{name}:{KEYS[name]}"]
    return args


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    limits = tmp_path_factory.mktemp("limits") / "limits.json"
    limits.write_text(json.dumps(LIMITS))
    args = [*key_args("alice", "bob", "carol", "dave", "ops"), "--key-limits", str(limits), "--no-access-log"]
    return make_server(args, api_key=KEYS["alice"])  # the scope defaults to "key": keys are configured


@pytest.fixture(scope="module")
def shared_server(make_server):
    args = [*key_args("alice", "bob", "ops"), "--prefix-cache-scope", "global", "--no-access-log"]
    return make_server(args, api_key=KEYS["alice"])


def client(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[name], max_retries=0, timeout=120)


def cached(server, name: str, prompt: str, **extra) -> int:
    r = client(server, name).completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
    )
    assert r.usage.prompt_tokens >= 48
    return r.usage.prompt_tokens_details.cached_tokens


def complete(server, name: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        headers=bearer(name),
        timeout=120,
        json={"model": MODEL, "temperature": 0, **body},
    )


def usage(server) -> dict:
    r = httpx.get(server.url + "/admin/usage", headers=bearer("ops"), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["keys"]


# ---- roles -------------------------------------------------------------------------------------------


def test_admin_routes_need_an_admin_key(server):
    for path in ("/admin/usage", "/admin/state"):
        r = httpx.get(server.url + path, headers=bearer("alice"), timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
        assert httpx.get(server.url + path, headers=bearer("ops"), timeout=10).status_code == 200
    # An admin key is also a client: it may generate like any user.
    assert client(server, "ops").completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.total_tokens


# ---- visibility --------------------------------------------------------------------------------------


class Watcher(threading.Thread):
    """Reads /v1/fornax/events as one key until `done(events)` says so."""

    def __init__(self, server, name: str, done: Callable[[list[dict]], bool]) -> None:
        super().__init__(daemon=True)
        self.server, self.name, self.done = server, name, done
        self.events: list[dict] = []
        self.opened = threading.Event()

    def run(self) -> None:
        url = self.server.url + "/v1/fornax/events"
        with httpx.stream("GET", url, headers=bearer(self.name), timeout=60) as r:
            for line in r.iter_lines():
                self.opened.set()
                if line.startswith("data:"):
                    self.events.append(json.loads(line[5:]))
                    if self.done(self.events):
                        return


def finished(n: int) -> Callable[[list[dict]], bool]:
    return lambda events: sum(e["type"] == "finished" for e in events) >= n


def test_event_stream_shows_a_user_only_their_own_requests(server):
    mine, everyone = Watcher(server, "alice", finished(1)), Watcher(server, "ops", finished(2))
    for watcher in (mine, everyone):
        watcher.start()
        assert watcher.opened.wait(30)
    bob = complete(server, "bob", {"prompt": "Bob's secret plan:", "max_tokens": 4}).json()
    alice = complete(server, "alice", {"prompt": "Alice says", "max_tokens": 4}).json()
    for watcher in (mine, everyone):
        watcher.join(timeout=60)
        assert not watcher.is_alive()
    # Without the filter alice's stream would end at bob's `finished`, which comes first.
    assert {e["request_id"] for e in mine.events} == {alice["id"]}, mine.events
    assert [e["type"] for e in mine.events].count("token") == 4
    assert all(alice["id"] != b for e in mine.events for b in e.get("batch", []))  # its own, not listed
    assert {e["request_id"] for e in everyone.events} == {alice["id"], bob["id"]}
    # Following one request: own ones only; another key's id is unknown to this key.
    follow = server.url + "/v1/fornax/events"
    r = httpx.get(follow, params={"request_id": bob["id"]}, headers=bearer("alice"), timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    for name in ("bob", "ops"):
        with httpx.stream(
            "GET", follow, params={"request_id": bob["id"]}, headers=bearer(name), timeout=10
        ) as r:
            assert r.status_code == 200


def test_live_snapshot_lists_only_own_requests(server):
    stop, seen = threading.Event(), threading.Event()

    def bob_streams() -> None:  # a long request, abandoned once the snapshots are taken
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 512,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", server.url + "/v1/completions", headers=bearer("bob"), json=body, timeout=120
        ) as r:
            for _ in r.iter_lines():
                seen.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=bob_streams, daemon=True)
    thread.start()
    try:
        assert seen.wait(60)
        running = live(server, "ops")["running"]
        assert len(running) == 1
        bob_id = running[0]["request_id"]
        alice_view = live(server, "alice")
        assert bob_id in [r["request_id"] for r in live(server, "ops")["running"]]  # still running meanwhile
        assert alice_view["running"] == [] and alice_view["num_running"] == 1  # counted, not listed
        assert [r["request_id"] for r in live(server, "bob")["running"]] == [bob_id]
    finally:
        stop.set()
        thread.join(timeout=60)


def live(server, name: str) -> dict:
    r = httpx.get(server.url + "/v1/fornax/live", params={"once": "true"}, headers=bearer(name), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# ---- prefix cache scope ------------------------------------------------------------------------------


def test_prefix_cache_is_per_key_by_default(server):
    prompt = "Key scope. " + PROMPT
    assert cached(server, "alice", prompt) == 0
    assert cached(server, "bob", prompt) == 0  # alice's blocks are there, but not for bob
    assert cached(server, "alice", prompt) >= 32  # ... they are: alice hits them
    assert cached(server, "bob", prompt) >= 32  # bob's own copy, from his first request
    # vLLM's cache_salt splits a key's cache further.
    assert cached(server, "alice", prompt, cache_salt="run-2") == 0
    assert cached(server, "alice", prompt, cache_salt="run-2") >= 32


def test_prefix_cache_scope_global_is_shared(shared_server):
    prompt = "Global scope. " + PROMPT
    assert cached(shared_server, "alice", prompt) == 0
    assert cached(shared_server, "bob", prompt) >= 32
    assert cached(shared_server, "bob", prompt, cache_salt="mine") == 0


# ---- rate limits -------------------------------------------------------------------------------------


def test_requests_per_minute(server):
    body = {"prompt": [100] * 4, "max_tokens": 1}
    assert complete(server, "carol", body).status_code == 200
    assert complete(server, "carol", body).status_code == 200
    r = complete(server, "carol", body)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert complete(server, "alice", body).status_code == 200  # other keys are not limited
    carol = usage(server)["carol"]
    assert carol["rejected_rate_limited"] == 1 and carol["requests"] == 2
    assert carol["rate_limit"]["requests_per_minute"] == 2 and carol["rate_limit"]["window_requests"] == 2


def test_tokens_per_minute_reserve_then_count_what_was_used(server):
    # 10 prompt tokens + max_tokens 150 are reserved; EOS comes first, so 11 are used.
    body = {"prompt": [100] * 10, "max_tokens": 150, "logit_bias": {EOS: 100}}
    used = []
    for _ in range(2):  # the second fits only because the first gave back its unused tokens
        r = complete(server, "dave", body)
        assert r.status_code == 200, r.text
        used.append(r.json()["usage"]["total_tokens"])
    assert used == [11, 11]
    r = complete(server, "dave", {**body, "max_tokens": 185})  # 195 more would pass 200
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60, r.text
    r = complete(server, "dave", {**body, "max_tokens": 250})  # can never fit: no Retry-After
    assert (
        r.status_code == 429
        and "Retry-After" not in r.headers
        and "max_tokens" in r.json()["error"]["message"]
    )
    dave = usage(server)["dave"]
    assert dave["rejected_rate_limited"] == 2
    assert dave["rate_limit"] == {
        "requests_per_minute": None,
        "tokens_per_minute": 200,
        "window_requests": 2,
        "window_tokens": sum(used),
    }
