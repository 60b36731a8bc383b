"""A shortened soak (benchmarks/soak.py) through a real server with make run's flags: a few
hundred mixed requests, a fifth of them cut by their client at a random moment and some
with broken bodies; then no KV block is held, the integrity check passes, nothing hangs,
nothing answers 5xx and every well-formed request is answered in full. RSS growth, the
full soak's fifth goal, needs thousands of requests: only the benchmark measures it.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from benchmarks import soak
from tests.support import MAKE_RUN_FLAGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(list(MAKE_RUN_FLAGS))


def test_every_malformed_body_gets_a_4xx_envelope(server):
    plans = [soak.malformed_plan(i, i, soak.DEFAULT_MODEL) for i in range(len(soak.MALFORMED))]

    async def send_all() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(soak.run_one(client, p, {}, 60) for p in plans))

    results = asyncio.run(send_all())
    wrong = [(r.plan.label, r.status, r.detail) for r in results if r.outcome != soak.REJECTED]
    assert not wrong, wrong
    server.assert_idle()


def _server_errors(server) -> dict[int, int]:
    async def read() -> dict[int, int] | None:
        async with httpx.AsyncClient(base_url=server.url) as client:
            return await soak.server_error_statuses(client, server.admin_headers)

    counts = asyncio.run(read())
    assert counts is not None
    return counts


def test_a_client_gone_while_sending_its_body_is_no_server_error(server):
    """Found by the soak: a client that left while its body was being read was logged as an
    unhandled error, twice with its traceback, and counted as a 500."""
    before = _server_errors(server)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + b'{"model": ')
            time.sleep(0.3)  # the route is waiting for the rest of the body when the socket closes
    time.sleep(0.5)
    after = _server_errors(server)
    assert {s: n for s, n in after.items() if s >= 500} == {s: n for s, n in before.items() if s >= 500}
    assert after.get(499, 0) - before.get(499, 0) == 3, (before, after)
    log = server.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "Exception in ASGI application" not in log
    server.assert_idle()


def test_shortened_soak_leaks_nothing(server):
    requests, concurrency = 300, 24
    # Outputs of 8-32 tokens (the benchmark: 8-48): under a minute even beside other tests.
    report = soak.run_soak(server.url, requests, concurrency, max_tokens=(8, 32), pid=server.proc.pid, seed=1)
    summary = report.summary()
    print(summary)
    goals = report.goals(check_rss=False)
    assert all(goals.values()), summary
    assert report.done == requests, summary
    assert report.outcomes[soak.REJECTED] == round(requests * 0.05), summary
    assert report.outcomes[soak.DISCONNECTED] >= requests * 0.2 / 2, summary  # most cuts land mid-request
    assert report.final_state["aborted_requests"] >= 1, summary
    assert report.server_errors is not None and report.num_server_5xx == 0, summary
    server.assert_idle()
