"""Cross-origin access for the visualizer pages of the router's own replicas.

Why: the live visualizer (/ui on a replica, `?router=URL`) sends its request through the
router to show which replica served it and why. That page's origin is its replica, so its
calls to the router are cross-origin: the browser first sends a preflight OPTIONS (the page
sends an Authorization header and a JSON body) and afterwards hides every response header
not named in Access-Control-Expose-Headers, x-fornax-replica and x-fornax-route-reason
included.

Which origins: only the replicas' own (the base URLs the router knows them by), so there is
no flag to set and no wider door. A page of any other site gets no CORS headers, and the
browser keeps it from reading the router's answers: an open router on a private network
stays out of reach of the web pages its users happen to visit. Keys are Bearer headers,
never cookies, so there is no credentials mode.

Requests without an Origin header (every non-browser client) pass untouched, after one scan
of their headers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXPOSED = "x-fornax-replica, x-fornax-route-reason, x-fornax-attempts"
PREFLIGHT_MAX_AGE_S = 600  # the browser may skip the preflight for this long
DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> str:
    """A replica's base URL (normalized: scheme://host[:port]) as a browser spells its
    origin, which leaves out the scheme's default port."""
    parts = urlsplit(url)
    if parts.port is None or parts.port != DEFAULT_PORTS.get(parts.scheme):
        return url
    return f"{parts.scheme}://{parts.netloc.rsplit(':', 1)[0]}"


class ReplicaOriginsCors:
    """ASGI wrapper: CORS for requests whose Origin is one of `urls()`' origins."""

    def __init__(self, app: ASGIApp, urls: Callable[[], Iterable[str]]) -> None:
        self.app, self.urls = app, urls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None or origin not in {origin_of(u) for u in self.urls()}:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
            # Answered here, before the key check: a browser never sends a key with a preflight.
            await _preflight(origin)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-expose-headers", EXPOSED.encode()),
                    (b"vary", b"Origin"),
                ]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _preflight(origin: str) -> Response:
    return Response(
        status_code=204,
        headers={
            "access-control-allow-origin": origin,
            "access-control-allow-methods": "GET, POST",
            "access-control-allow-headers": "authorization, content-type",
            "access-control-max-age": str(PREFLIGHT_MAX_AGE_S),
            "vary": "Origin",
        },
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
