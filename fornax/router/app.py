"""The router's HTTP face: the OpenAI-compatible routes relayed to replicas, the union of
their models, its own /health and /metrics, and the app factory and uvicorn run.

The hot path does one bounded body read, one JSON parse (to learn the model and, for the
cache-aware policy, the prompt), then hands the same bytes to the proxy. It is raw ASGI
(`Relay`): the relayed POSTs skip FastAPI's middleware stack and routing, which cost about
a fifth of the router's own time per request; everything else is an ordinary FastAPI route.
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
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fornax import __version__
from fornax.router.admin import Gate, Keys
from fornax.router.admin import routes as admin_routes
from fornax.router.config import RouterConfig
from fornax.router.core import Router
from fornax.router.cors import ReplicaOriginsCors
from fornax.router.metrics import CONTENT_TYPE
from fornax.router.prompt import RouteRequest, route_request
from fornax.router.proxy import upstream_headers
from fornax.router.replicas import ReplicaSet
from fornax.server.errors import ApiError, install_error_handlers

logger = logging.getLogger("fornax.router")
INLINE_PARSE_BYTES = 64 << 10  # bodies above this are parsed off the event loop
CLIENT_CLOSED = 499  # never seen by the client: it has left
routes = APIRouter()


# path -> endpoint (the proxy's name for it, a metrics label)
RELAY_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
}


def create_app(config: RouterConfig, replicas: ReplicaSet | None = None) -> RouterApp:
    """The router app; `replicas`: a set the caller keeps, to change membership in-process."""
    router = Router(config, replicas)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    keys = Keys(config)
    relay = Relay(router, keys)
    # The relayed paths are routes too (never reached by a POST, see RouterApp), so that any
    # other method gets the same 405 as before.
    relayed = [Route(path, endpoint=relay, methods=["POST"]) for path in RELAY_PATHS]
    # CORS for the replicas' visualizer pages (fornax/router/cors.py): around the relay, which
    # skips the middleware, and outermost in the middleware, so preflights pass the key check.
    cors_relay = ReplicaOriginsCors(relay, router.replicas.urls)
    app = RouterApp(
        cors_relay,
        title="fornax router",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        routes=relayed,
    )
    app.state.router = router
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(admin_routes)
    app.add_middleware(Gate, keys=keys)
    app.add_middleware(ReplicaOriginsCors, urls=router.replicas.urls)
    return app


def _router(request: Request) -> Router:
    return request.app.state.router


# ---- relayed routes ------------------------------------------------------------------------------


class RouterApp(FastAPI):
    """FastAPI, but a POST to a relayed path goes straight to `relay`, past the middleware
    stack and the routing (Relay checks the keys itself)."""

    def __init__(self, relay: ASGIApp, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in RELAY_PATHS:
            await self.relay(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


class Relay:
    """The relayed routes as one raw ASGI app: keys, body, route, forward, answer. Errors
    answer as the FastAPI handlers would (fornax.server.errors): an ApiError as its
    envelope, a client gone while its body was read as 499, a bug as a logged 500."""

    def __init__(self, router: Router, keys: Keys) -> None:
        self.router, self.keys = router, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        denial = self.keys.denial(scope)
        path = scope["path"]
        response = denial.response(path) if denial is not None else await self._answer(scope, receive)
        await response(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive) -> Response:
        try:
            return await self._forward(scope, receive)
        except ApiError as exc:
            return exc.response(scope["path"])
        except ClientDisconnect:
            return ApiError(CLIENT_CLOSED, "client closed the request").response(scope["path"])
        except Exception:
            logger.exception("unhandled error on POST %s", scope["path"])
            return ApiError(500, "internal server error", code="internal_error").response(scope["path"])

    async def _forward(self, scope: Scope, receive: Receive) -> Response:
        config, path = self.router.config, scope["path"]
        headers = Headers(scope=scope)
        body = await read_body(receive, headers.get("content-length"), config.max_body_bytes)
        endpoint = RELAY_PATHS[path]
        parsed = await parse_json(body)
        route = route_request(endpoint, parsed)
        upstream = upstream_headers(headers, config.replica_api_key)
        # A turn that continues a stored response goes where that response is stored.
        seeks = (
            endpoint == "responses" and isinstance(parsed, dict) and bool(parsed.get("previous_response_id"))
        )
        work = self.router.proxy.forward(endpoint, path, body, route, upstream, seeks_stored=seeks)
        return await until_disconnected(receive, work)


async def read_body(receive: Receive, declared: str | None, max_bytes: int) -> bytes:
    """The whole body, refused (413) past `max_bytes` whether or not a length was declared;
    ClientDisconnect if the client leaves first."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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


async def until_disconnected(receive: Receive, work: Awaitable[Response]) -> Response:
    """`work`'s answer, unless the client leaves first: then it is cancelled, which closes
    the upstream request, so the replica aborts the generation instead of finishing it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
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


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
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


@routes.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
async def stored_response(request: Request, response_id: str) -> Response:
    """A stored Responses object lives on the replica that made it: each replica is asked in
    turn until one has it (a 404 from every one is the answer)."""
    router = _router(request)
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    upstream = upstream_headers(request.headers, router.config.replica_api_key)
    work = router.proxy.forward(
        "responses",
        path,
        b"",
        RouteRequest("stored_response", None),
        upstream,
        method=request.method,
        seeks_stored=True,
    )
    return await until_disconnected(request.receive, work)


@routes.get("/health")
async def health(request: Request) -> Response:
    replicas = _router(request).replicas.members()
    healthy = sum(1 for r in replicas if r.available)
    if healthy:
        return JSONResponse({"status": "ok", "healthy_replicas": healthy, "replicas": len(replicas)})
    return ApiError(
        503,
        f"no replica is available ({len(replicas)} known)",
        code="no_healthy_replica",
        headers={"Retry-After": "1"},
    ).response()


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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the poller's: one INFO line per poll otherwise
    # httptools (C) parses the clients' requests and uvloop runs the loop: together they took
    # about an eighth off the router's CPU time per relayed request (h11 and asyncio measured).
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=30,
        lifespan="on",
        http="httptools",
        loop="uvloop",
    )
    uvicorn.Server(uv_config).run()
    return 0
