"""Who may call the router, and the membership routes for orchestrators.

Keys work as in `fornax serve`: with none configured the router is open; with any, every
path but /health (and /metrics with --public-metrics) needs `Authorization: Bearer <key>`
(or `x-api-key: <key>`),
compared with hmac.compare_digest against every key without stopping at a match. The
/router/* routes need an admin key (--admin-key); with user keys but no admin key they
answer 403 to everyone.

GET /router/replicas     each replica: url, tags, healthy, ready, in-flight, load, polled
                         load, models, ejections (removed ones still draining listed apart)
POST /router/replicas    {"url": ..., "tags": {...}}: add (201, after its first health check:
                         "healthy" says whether it is in rotation) or retag (200)
DELETE /router/replicas  {"url": ...} (or ?url=...): remove, draining what runs on it
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fornax.config import ConfigError
from fornax.router.config import RouterConfig
from fornax.router.core import Router
from fornax.server.errors import ApiError, bad_request

USER, ADMIN = "user", "admin"
ADMIN_PREFIX = "/router/"
MAX_ADMIN_BODY = 64 << 10

routes = APIRouter()


class Keys:
    """Who may call what: the keys, and the paths that need none."""

    def __init__(self, config: RouterConfig) -> None:
        self.keys = [(key.encode(), USER) for _, key in config.api_keys]
        self.keys += [(key.encode(), ADMIN) for _, key in config.admin_keys]
        self.public = {"/health", "/version"} | ({"/metrics"} if config.public_metrics else set())

    def role(self, authorization: str | None, api_key: str | None = None) -> str | None:
        """The role of the key presented as `Authorization: Bearer` or (Anthropic's clients)
        `x-api-key`; None when it matches no key."""
        if not self.keys:
            return ADMIN  # an open router
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else (api_key or "").strip().encode()
        found: str | None = None
        for key, role in self.keys:  # no early exit: the time taken does not tell which key
            if hmac.compare_digest(presented, key) and found is None:
                found = role
        return found if presented else None

    def denial(self, scope: Scope) -> ApiError | None:
        """The error an HTTP request is refused with (401, 403), or None when it may pass."""
        path: str = scope.get("path", "")
        if path in self.public or not self.keys:
            return None
        role = self.role(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
        if role is None:
            return ApiError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if path.startswith(ADMIN_PREFIX) and role != ADMIN:
            return ApiError(403, "/router/* needs an admin key (--admin-key)", code="permission_denied")
        return None


class Gate:
    """ASGI middleware: authentication and the admin role check, before any route."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        denial = self.keys.denial(scope) if scope["type"] == "http" else None
        if denial is not None:
            await denial.response(scope.get("path", ""))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _router(request: Request) -> Router:
    return request.app.state.router


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_ADMIN_BODY:
        raise ApiError(413, f"the body is over {MAX_ADMIN_BODY} bytes")
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _url(body: dict[str, Any], request: Request) -> str:
    url = body.get("url", request.query_params.get("url"))
    if not isinstance(url, str) or not url:
        raise bad_request("'url' (a replica's base URL) is required", param="url")
    return url


@routes.get("/router/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    router = _router(request)
    return {
        "object": "list",
        "policy": router.policy.name,
        "data": [r.describe() for r in router.replicas],
        "draining": [r.describe() for r in router.replicas.draining()],
    }


@routes.post("/router/replicas")
async def add_replica(request: Request) -> JSONResponse:
    router, body = _router(request), await _json_object(request)
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, dict) and all(isinstance(v, str) for v in tags.values())):
        raise bad_request("'tags' must be an object of strings", param="tags")
    url = _url(body, request)
    try:
        existed = router.replicas.get(url) is not None
        replica = router.replicas.add(url, tags)
    except ConfigError as exc:
        raise bad_request(str(exc), param="url") from None
    if not existed:
        # Answer after its first health check (at most --poll-timeout): a replica that is up
        # is then in rotation when this returns, so whoever added it (the cluster controller,
        # a deploy script) can send traffic at once instead of meeting a 503 for a poll tick.
        with contextlib.suppress(asyncio.TimeoutError):  # the check itself goes on (shielded)
            await asyncio.wait_for(router.check(replica), router.config.poll_timeout_s)
    return JSONResponse(replica.describe(), status_code=200 if existed else 201)


@routes.delete("/router/replicas")
async def remove_replica(request: Request) -> dict[str, Any]:
    router, body = _router(request), await _json_object(request)
    url = _url(body, request)
    try:
        removed = router.replicas.remove(url)
    except ConfigError as exc:
        raise bad_request(str(exc), param="url") from None
    if not removed:
        raise ApiError(404, f"no replica {url} in the set", param="url", code="replica_not_found")
    return {"url": url, "removed": True}
