"""Loading (503), an open server's warning, queue-full 429s, and a SIGTERM drain with
requests in flight (they finish, new ones get 503, the process exits 0)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(make_server):
    # One sequence at a time and one queued request: easy to fill the queue.
    return make_server(
        ["--max-num-seqs", "1", "--max-queued-requests", "1", "--shutdown-timeout", "60"], wait=False
    )


def test_loading_answers_503_then_ready(server):
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = server.health_status()
        seen.append(status)
        if status == 503:
            r = httpx.get(server.url + "/v1/models", timeout=5)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            break
        time.sleep(0.05)
    assert 503 in seen, seen
    server.wait_ready()
    assert httpx.get(server.url + "/v1/models").status_code == 200  # open: no key needed
    assert "no API key configured" in server.log()


def test_queue_full_is_429_with_retry_after(server):
    results: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 12, "ignore_eos": True}

    def send() -> None:
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert 200 in statuses and 429 in statuses, statuses
    assert set(statuses) <= {200, 429}
    for r in results:
        if r.status_code == 429:
            assert r.headers["Retry-After"].isdigit()
            assert r.json()["error"]["type"] == "rate_limit_error"
    server.assert_idle()
    assert server.state()["rejected_queue_full"] == statuses.count(429)


def test_sigterm_drains_inflight_then_exits_0(server):
    max_tokens = 48
    results: dict[int, dict] = {}
    first_chunk = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"Story {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, reason, usage = "", None, None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                first_chunk[i].set()
                for c in chunk["choices"]:
                    text += c["text"]
                    reason = c["finish_reason"] or reason
                usage = chunk.get("usage") or usage
        results[i] = {"status": r.status_code, "reason": reason, "usage": usage}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    threads[0].start()
    assert first_chunk[0].wait(60)
    threads[1].start()  # queued behind the first (one sequence at a time)
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert server.health_status() == 503
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    for t in threads:
        t.join(120)
    assert server.proc.wait(60) == 0, server.log()
    for i in range(2):
        assert results[i]["status"] == 200 and results[i]["reason"] == "length", results
        assert results[i]["usage"]["completion_tokens"] == max_tokens
