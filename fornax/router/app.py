"""The router's HTTP face: the OpenAI-compatible routes relayed to replicas, the union of
their models, its own /health and /metrics, and the app factory and uvicorn run.

The hot path does one bounded body read, one JSON parse (to learn the model and, for the
cache-aware policy, the prompt), then hands the same bytes to the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fornax import __version__
from fornax.router.admin import Gate
from fornax.router.admin import routes as admin_routes
from fornax.router.config import RouterConfig
from fornax.router.core import Router
from fornax.router.metrics import CONTENT_TYPE
from fornax.router.prompt import route_request
from fornax.router.proxy import upstream_headers
from fornax.router.replicas import ReplicaSet
from fornax.server.errors import ApiError, install_error_handlers

logger = logging.getLogger("fornax.router")
INLINE_PARSE_BYTES = 64 << 10  # bodies above this are parsed off the event loop
CLIENT_CLOSED = 499  # never seen by the client: it has left
routes = APIRouter()


def create_app(config: RouterConfig, replicas: ReplicaSet | None = None) -> FastAPI:
    """The router app; `replicas`: a set the caller keeps, to change membership in-process."""
    router = Router(config, replicas)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="fornax router", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)  # fmt: skip
    app.state.router = router
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(admin_routes)
    app.add_middleware(Gate, config=config)
    return app


def _router(request: Request) -> Router:
    return request.app.state.router


# ---- relayed routes ------------------------------------------------------------------------------


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _relay(request, "chat")


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _relay(request, "completions")


@routes.post("/tokenize")
async def tokenize(request: Request) -> Response:
    return await _relay(request, "tokenize")


@routes.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return await _relay(request, "detokenize")


async def _relay(request: Request, endpoint: str) -> Response:
    router = _router(request)
    body = await read_body(request, router.config.max_body_bytes)
    route = route_request(endpoint, await parse_json(body))
    headers = upstream_headers(request.headers, router.config.replica_api_key)
    return await until_disconnected(request, router.proxy.forward(endpoint, request.url.path, body, route, headers))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused (413) past `max_bytes` whether or not a length was declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")


async def parse_json(body: bytes) -> Any:
    """The parsed body, or None when it is not JSON (a replica will answer the 400)."""
    try:
        if len(body) <= INLINE_PARSE_BYTES:
            return json.loads(body)
        return await asyncio.to_thread(json.loads, body)  # ~70 ms for 4 MiB of token ids
    except (ValueError, RecursionError):
        return None


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s answer, unless the client leaves first: then it is cancelled, which closes
    the upstream request, so the replica aborts the generation instead of finishing it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the router's own routes --------------------------------------------------------------------


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The union of the replicas' models (first card seen per id)."""
    cards: dict[str, dict[str, Any]] = {}
    for replica in _router(request).replicas:
        for card in replica.model_cards:
            cards.setdefault(card["id"], card)
    return {"object": "list", "data": list(cards.values())}


@routes.get("/health")
async def health(request: Request) -> Response:
    replicas = _router(request).replicas.members()
    healthy = sum(1 for r in replicas if r.available)
    if healthy:
        return JSONResponse({"status": "ok", "healthy_replicas": healthy, "replicas": len(replicas)})
    return ApiError(503, f"no replica is available ({len(replicas)} known)", code="no_healthy_replica",
                    headers={"Retry-After": "1"}).response()  # fmt: skip


@routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    router = _router(request)
    return Response(router.metrics.render(router.replicas), media_type=CONTENT_TYPE)


def serve(config: RouterConfig, replicas: ReplicaSet | None = None) -> int:
    """Run the router until it is stopped (SIGINT/SIGTERM); the process exit code."""
    app = create_app(config, replicas)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per relayed request otherwise
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                               log_level=config.log_level, access_log=config.access_log,
                               timeout_graceful_shutdown=30, lifespan="on")  # fmt: skip
    uvicorn.Server(uv_config).run()
    return 0
