"""The server's side of the metrics: GET /metrics, and the middleware that counts every
4xx/5xx response by status.

The middleware is the outermost one, so it also sees the gate's 401s and 503s; an
exception that escapes every handler (answered 500 by Starlette outside it) is counted as
a 500 on its way out.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fornax.metrics.prometheus import CONTENT_TYPE, Metrics, render_all, snapshot_engine
from fornax.server.state import ServerState

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.fornax
    for model in state.models.models:
        engine = model.engine
        if engine is not None and engine.dead_error is None:
            model.metrics.refresh(await engine.call(snapshot_engine))
    return Response(render_all([m.metrics for m in state.models.models]), media_type=CONTENT_TYPE)


class StatusCounter:
    """ASGI middleware: report each HTTP response's status to `Metrics.on_response_status`."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.on_response_status(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            if not started:
                self.metrics.on_response_status(500)
            raise
