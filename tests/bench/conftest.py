"""A tiny fake OpenAI-compatible streaming server, run for real by uvicorn on a loopback port.

Its behaviour is set per test through `FakeServer.cfg`: the delay before the first token and
between tokens, how many tokens each chunk carries, whether usage is sent, every how many
requests to answer 500, and whether POST /tokenize exists. It records what it was asked.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # answer HTTP 500 to every k-th request (1-based); 0 = never
    tokenize_ratio: float | None = None  # tokens per word from /tokenize; None = no such route


@dataclass
class FakeState:
    cfg: FakeConfig = field(default_factory=FakeConfig)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    generation: int = 0  # bumped by reset(), so streams left over from an earlier test don't count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, **cfg: Any) -> None:
        self.cfg = FakeConfig(**cfg)
        self.bodies.clear()
        with self.lock:
            self.in_flight = self.max_in_flight = 0
            self.generation += 1


def _chunk(kind: str, text: str | None, role: bool = False) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    async def stream(kind: str, body: dict[str, Any], generation: int) -> AsyncIterator[bytes]:
        cfg = state.cfg
        n = int(body.get("max_tokens") or 16)
        try:
            if kind == "chat":
                yield f"data: {json.dumps(_chunk(kind, None, role=True))}\n\n".encode()
            await asyncio.sleep(cfg.ttft_s)
            sent = 0
            while sent < n:
                k = min(cfg.tokens_per_chunk, n - sent)
                if sent:
                    await asyncio.sleep(cfg.itl_s)
                yield f"data: {json.dumps(_chunk(kind, 'tok ' * k))}\n\n".encode()
                sent += k
            if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            with state.lock:
                if generation == state.generation:
                    state.in_flight -= 1

    async def handle(kind: str, request: Request) -> Any:
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
            number = len(state.bodies)
        if state.cfg.fail_every and number % state.cfg.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
        with state.lock:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            generation = state.generation
        return StreamingResponse(stream(kind, body, generation), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle("completions", request)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        if state.cfg.tokenize_ratio is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        words = len((await request.json())["prompt"].split())
        return {"count": round(words * state.cfg.tokenize_ratio)}

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="session")
def _fake_server_session() -> Any:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield FakeServer(f"http://127.0.0.1:{port}", state)
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake_server(_fake_server_session: FakeServer) -> FakeServer:
    _fake_server_session.state.reset()
    return _fake_server_session


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL nothing listens on (bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
