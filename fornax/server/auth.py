"""API keys and the gate every HTTP request passes before routing.

Default deny: with keys configured, every path needs `Authorization: Bearer <key>` (or
`x-api-key: <key>`, the header Anthropic's clients send) except /health (and /metrics with
--public-metrics); when both headers come, the Bearer token is the one checked. The key is
compared against every configured key with hmac.compare_digest, without stopping at the first
match, so timing does not tell which key (or how much of one) was right. Each key has a role
(server/tenancy.py): /admin/* answers 403 to a user key. The gate puts the key's name and
role on the request scope's state (`key_name`, `key_role`). It also answers 503 while the
model loads or the server drains, so no route has to check.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fornax.server.errors import ApiError
from fornax.server.state import ServerState
from fornax.server.tenancy import ADMIN, USER

ANONYMOUS = "anonymous"
# Paths that stay reachable while draining (to watch the drain) or loading.
_ALWAYS_AVAILABLE = ("/health", "/version", "/admin/")
# The visualizer's static page: it holds no data, and a browser cannot send a Bearer header
# when it navigates. Everything the page then fetches goes through the gate with its key.
_PUBLIC_PAGES = ("/", "/ui", "/openapi.json")  # the API's description holds no data either
_PUBLIC_PAGE_PREFIX = "/ui/"
# Beside /admin/*, the routes only an operator may call: loading code-like files into the model.
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class KeyStore:
    def __init__(
        self, keys: tuple[tuple[str, str], ...], admin_keys: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._keys = [(name, key.encode(), USER) for name, key in keys]
        self._keys += [(name, key.encode(), ADMIN) for name, key in admin_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None, api_key: str | None = None) -> tuple[str, str] | None:
        """(name, role) of the key in an Authorization header (a Bearer token), else in an
        x-api-key header; None if it matches none. With no keys configured everyone is the
        anonymous admin (an open server)."""
        if not self._keys:
            return ANONYMOUS, ADMIN
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not presented and api_key is not None:
            presented = api_key.strip().encode()
        found: tuple[str, str] | None = None
        for name, key, role in self._keys:  # no early exit: compare against all keys
            if hmac.compare_digest(presented, key) and found is None:
                found = (name, role)
        return found if presented else None


class Gate:
    """ASGI middleware: authentication, then availability (loading, draining)."""

    def __init__(self, app: ASGIApp, state: ServerState, keys: KeyStore) -> None:
        self.app, self.state, self.keys = app, state, keys
        self.public = {"/health", *_PUBLIC_PAGES} | ({"/metrics"} if state.config.public_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if path not in self.public and not path.startswith(_PUBLIC_PAGE_PREFIX):
            who = self.keys.identify(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
            if who is None:
                err = ApiError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await _send(err, scope, receive, send)
                return
            scope.setdefault("state", {}).update(key_name=who[0], key_role=who[1])
            if (path == "/admin" or path.startswith("/admin/") or path in ADMIN_PATHS) and who[1] != ADMIN:
                err = ApiError(
                    403,
                    f"this key may not use {path} (it needs an admin key: --admin-key)",
                    code="permission_denied",
                )
                await _send(err, scope, receive, send)
                return
            if not path.startswith(_ALWAYS_AVAILABLE) and not self.state.ready:
                await _send(_unavailable(self.state), scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unavailable(state: ServerState) -> ApiError:
    if state.engine_error is not None:
        message = f"the engine has stopped: {state.engine_error}"
    elif state.draining:
        message = "the server is shutting down"
    elif state.load_error:
        message = f"the model failed to load: {state.load_error}"
    else:
        message = "the model is still loading"
    return ApiError(503, message, code="service_unavailable", headers={"Retry-After": "1"})


async def _send(err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response: JSONResponse = err.response(scope.get("path", ""))  # the envelope depends on the path
    await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def key_name(scope_state: Any) -> str:
    return getattr(scope_state, "key_name", ANONYMOUS)


def key_role(scope_state: Any) -> str:
    """The role the gate found; a route the gate did not check is treated as a user's."""
    return getattr(scope_state, "key_role", USER)
