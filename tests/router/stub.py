"""A stand-in for `fornax serve`, in-process (uvicorn in a thread), whose failures a test
chooses: the router's failover rules checked in milliseconds, without a model.

It speaks enough of the fornax API: /health, /metrics (the real gauge names, written by
prometheus_client), /v1/models, chat/completions answering plain JSON or a stream of SSE
chunks like the real server's, and stored Responses (kept by the replica that made them).
`StubReplica.mode` says how the next generation requests fail (see `_generate`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from tests.support import free_port

MODEL = "stub-model"


class ThreadServer:
    """uvicorn serving `app` on a loopback port, in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> str:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    body = {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


class StubReplica:
    """mode: "ok"; "status:N" (answer N); "die_after:K" (stream K content chunks after the
    role chunk, then drop the connection; K=0: die right after the role chunk);
    "error_event:TYPE" (an in-band error event first). `delay` seconds between chunks."""

    def __init__(self, name: str, models: tuple[str, ...] = (MODEL,)) -> None:
        self.name = name
        self.reset(models)
        self.server = ThreadServer(self._app())

    def reset(self, models: tuple[str, ...] = (MODEL,)) -> None:
        self.models = models
        self.mode, self.delay, self.health_status = "ok", 0.0, 200
        self.running, self.waiting = 0.0, 0.0
        self.requests: list[dict[str, Any]] = []
        self.peers: list[int] = []  # the client port of each generation request
        self.poll_auth: dict[str, set[str | None]] = {}  # GET path -> the Authorization headers it got
        self.stored: set[str] = set()  # the Responses ids this replica holds

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> StubReplica:
        self.server.start()
        return self

    def _metrics(self) -> bytes:
        registry = CollectorRegistry()
        for name, value in (
            ("num_requests_running", self.running),
            ("num_requests_waiting", self.waiting),
            ("kv_cache_usage_perc", 0.25),
        ):
            Gauge(f"fornax:{name}", name, ["model_name"], registry=registry).labels(self.models[0]).set(value)
        return generate_latest(registry)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record_poll_auth(request: Request, call_next: Any) -> Response:
            if request.method == "GET":
                self.poll_auth.setdefault(request.url.path, set()).add(request.headers.get("authorization"))
            return await call_next(request)

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok" if self.health_status == 200 else "x"}, self.health_status)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self._metrics(), media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": "stub"} for m in self.models],
            }

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        @app.post("/tokenize")
        async def generate(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                err = {
                    "error": {
                        "message": "bad json",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                }
                return JSONResponse(err, 400)
            self.requests.append(body)
            self.peers.append(request.client.port if request.client else 0)
            return await self._generate(body, request.headers.get("authorization"))

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            previous = body.get("previous_response_id")
            if previous and previous not in self.stored:
                return _not_found(previous)
            rid = f"resp_{self.name}_{len(self.requests)}"
            self.stored.add(rid)
            return JSONResponse({"id": rid, "object": "response", "replica": self.name, "previous": previous})

        @app.api_route("/v1/responses/{rid}", methods=["GET", "DELETE"])
        async def stored(request: Request, rid: str) -> Response:
            self.requests.append({"method": request.method, "id": rid})
            if rid not in self.stored:
                return _not_found(rid)
            if request.method == "DELETE":
                self.stored.discard(rid)
                return JSONResponse({"id": rid, "object": "response", "deleted": True})
            return JSONResponse({"id": rid, "object": "response", "replica": self.name})

        return app

    async def _generate(self, body: dict[str, Any], auth: str | None) -> Response:
        mode = self.mode
        if mode.startswith("status:"):
            status = int(mode.split(":")[1])
            headers = {"Retry-After": "7"} if status == 429 else None
            err = {
                "error": {"message": f"{self.name} says {status}", "type": "x", "param": None, "code": None}
            }
            return JSONResponse(err, status, headers=headers)
        if not body.get("stream"):
            await asyncio.sleep(4 * self.delay)
            text = f"from {self.name}"
            return JSONResponse(
                {
                    "object": "chat.completion",
                    "replica": self.name,
                    "auth": auth,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )
        return StreamingResponse(self._events(mode), media_type="text/event-stream")

    async def _events(self, mode: str) -> AsyncIterator[str]:
        if mode.startswith("error_event:"):
            kind = mode.split(":")[1]
            yield f"data: {json.dumps({'error': {'message': 'engine gone', 'type': kind}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        yield chunk(role=True)
        die_after = int(mode.split(":")[1]) if mode.startswith("die_after:") else None
        for i in range(4):
            if die_after is not None and i >= die_after:
                yield chunk(finish="stop")[:40]  # half an event: the router must never relay it
                await asyncio.sleep(0.05)
                raise RuntimeError("stub replica dies mid-stream")
            await asyncio.sleep(self.delay)
            yield chunk(f"{self.name}-{i} ")
        yield chunk(finish="stop")
        yield "data: [DONE]\n\n"


def _not_found(rid: str) -> Response:
    err = {
        "message": f"no response {rid}",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    return JSONResponse({"error": err}, 404)
