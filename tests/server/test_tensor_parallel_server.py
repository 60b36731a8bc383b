"""A tensor-parallel server whose worker dies (fornax/engine/tensor_parallel.py): the engine
fails the way any engine fault does (docs/reliability.md): every request in flight gets an
`engine_dead` error, streams end with an error event, /health turns 503 and the process exits
non-zero, all within the collective timeout and never hung in one.

The server runs make run's weight forms (the file's int4 blocks, int8 x int8 large steps), cut
per rank, over two processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_faults import PROMPT, _post, _stream_events, assert_envelope, completion
from tests.support import MAKE_RUN_FLAGS

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT = 5
COLLECTIVE_TIMEOUT = 20


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` started through multiprocessing's spawn (its workers; not the
    resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        if parent == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_dead_worker_fails_every_request_turns_health_503_and_exits_non_zero(make_server) -> None:
    server = make_server(
        [
            "--tensor-parallel-size",
            "2",
            "--distributed-timeout",
            str(COLLECTIVE_TIMEOUT),
            *MAKE_RUN_FLAGS,
            "--no-access-log",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
        ]
    )
    r = httpx.post(server.url + "/v1/completions", json=completion(PROMPT), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    (worker,) = _spawned_children(server.proc.pid)

    async def scenario() -> tuple[list[httpx.Response], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=90) as client:
            long_ones = [_post(client, completion(PROMPT[i:], max_tokens=400)) for i in range(3)]
            stream = _stream_events(client, completion(PROMPT[1:], max_tokens=400))

            async def kill_later() -> None:
                await asyncio.sleep(1.0)  # the others are decoding by then
                os.kill(worker, signal.SIGKILL)

            *responses, _, events = await asyncio.gather(*long_ones, kill_later(), stream)
            return responses, events

    start = time.monotonic()
    responses, events = asyncio.run(scenario())
    for r in responses:
        assert assert_envelope(r, 503)["code"] == "engine_dead"
    assert events and events[-1]["error"]["code"] == "engine_dead"
    assert assert_envelope(httpx.get(server.url + "/health", timeout=5), 503)["code"] == "engine_dead"
    server.proc.wait(timeout=SHUTDOWN_TIMEOUT + 10)
    assert server.proc.returncode == 1, server.log()
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT + SHUTDOWN_TIMEOUT + 15
