"""The live inference visualizer: its page (/ui) and the endpoints the page reads.

    GET  /ui/...              the static page (public: it holds no data; every call it makes
                              sends the API key, which the page asks for)
    POST /v1/fornax/tokens    a prompt's tokens with their bytes and which ones the chat template added
    GET  /v1/fornax/events    SSE of engine lifecycle events (engine/events.py), all requests or
                              `?request_id=` one (its history first, ending when it finishes)
    GET  /v1/fornax/live      SSE of server-wide snapshots (queues, KV cache, throughput, TTFT/ITL)

Each takes `?model=` (a served name; default: the first model) on a server with several.

The page talks HTTP only, like any client (docs/architecture.md, "Layering"): it never sees engine objects.
With `?router=URL` it sends its chat request through a `fornax router` and shows which replica
ran it and why (app.js; the router lets its replicas' pages read it: fornax/router/cors.py).
A user key sees only its own requests in both streams (server/tenancy.py); an admin key all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from fornax.engine.async_engine import AsyncEngine
from fornax.engine.core import EngineCore
from fornax.metrics.live import LiveStats
from fornax.server.auth import key_name, key_role
from fornax.server.body_parser import parse_body
from fornax.server.errors import ApiError, bad_request
from fornax.server.limits import check_token_count, check_tokenize_input, message_texts
from fornax.server.model_set import ServedModel
from fornax.server.protocol import TokenizeRequest
from fornax.server.serving import sse_stream
from fornax.server.state import ServerState
from fornax.server.tenancy import ADMIN, Viewer

UI_DIR = Path(__file__).parent / "ui"
# Installed by `make setup` (npm), not committed: the page works without it, minus charts.
_VENDOR = {
    "uplot.js": UI_DIR / "vendor" / "node_modules" / "uplot" / "dist" / "uPlot.iife.min.js",
    "uplot.css": UI_DIR / "vendor" / "node_modules" / "uplot" / "dist" / "uPlot.min.css",
}
_PAGES = {"index.html", "app.js", "style.css"}
KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies from closing an idle stream

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.fornax


def _viewer(request: Request) -> Viewer:
    return Viewer(key_name(request.state), key_role(request.state) == ADMIN)


def _model(request: Request, name: str | None) -> ServedModel:
    return _state(request).models.find(name)


def _engine(model: ServedModel) -> AsyncEngine:
    """A loaded model's engine. The watching streams do not load a model, nor hold one loaded
    (an open page would pin it): the chat request the page sends does."""
    if model.engine is None:
        raise ApiError(
            503,
            f"the model '{model.name}' is not loaded yet",
            code="service_unavailable",
            headers={"Retry-After": "1"},
        )
    return model.engine


# ---- the page ----------------------------------------------------------------------------------------


@router.get("/", include_in_schema=False)
@router.get("/ui", include_in_schema=False)
async def to_ui() -> Response:
    return RedirectResponse("/ui/")


@router.get("/ui/", include_in_schema=False)
@router.get("/ui/{name}", include_in_schema=False)
@router.get("/ui/vendor/{name}", include_in_schema=False)
async def ui_file(request: Request, name: str = "index.html") -> Response:
    vendor = request.url.path.startswith("/ui/vendor/")
    path = _VENDOR.get(name) if vendor else (UI_DIR / name if name in _PAGES else None)
    if path is None or not path.is_file():
        raise ApiError(404, f"no such file: {request.url.path}", code="not_found")
    # no-cache: the page is small, and a stale app.js after an upgrade would talk an old protocol
    return FileResponse(path, headers={"Cache-Control": "no-cache"})


# ---- tokens ------------------------------------------------------------------------------------------


@router.post("/v1/fornax/tokens")
async def tokens(request: Request, model: str | None = None) -> dict[str, Any]:
    """Like /tokenize, plus per token: its text, its bytes, and whether the chat template added it.

    Bounded like /tokenize (at most the context's tokens), and built in a worker thread: the
    per-token entries are Python work proportional to the prompt."""
    state = _state(request)
    req = await parse_body(request, TokenizeRequest, state.config.max_body_bytes)
    engine = await state.models.lease(
        _model(request, model or req.model), request.scope.setdefault("state", {})
    )
    messages, param = check_tokenize_input(req, state.config, engine.max_model_len)
    try:
        return await asyncio.to_thread(_token_table, engine, req, messages)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def _token_table(
    engine: AsyncEngine, req: TokenizeRequest, messages: list[dict[str, Any]] | None
) -> dict[str, Any]:
    tok = engine.tokenizer
    if messages is not None:
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        assert isinstance(text, str)
        # The same call apply_chat_template(tokenize=True) makes, but keeping character offsets.
        enc = tok.backend.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), list(enc.offsets)
        spans = _content_spans(text, message_texts(messages))
    else:
        assert req.prompt is not None
        ids = tok.encode(req.prompt, req.add_special_tokens)
        offsets, spans = [], []
    check_token_count(ids, engine.max_model_len, "prompt" if messages is None else "messages")
    special = set(tok.all_special_ids)
    out = []
    for i, token_id in enumerate(ids):
        in_content = bool(offsets) and any(a <= offsets[i][0] and offsets[i][1] <= b for a, b in spans)
        out.append(
            {
                "id": token_id,
                "text": tok.decode([token_id], skip_special_tokens=False),
                "bytes": tok.token_bytes(token_id).hex(),
                "special": token_id in special,
                "template": bool(offsets) and not in_content,
            }
        )
    return {"tokens": out, "ids": ids, "count": len(ids), "max_model_len": engine.max_model_len}


def _content_spans(text: str, contents: list[str]) -> list[tuple[int, int]]:
    """Where each message's own text sits in the rendered template (searched in order)."""
    spans, at = [], 0
    for content in contents:
        if not content:
            continue
        found = text.find(content, at)
        if found < 0:
            continue  # the template rewrote it (e.g. stripped): its tokens count as template
        spans.append((found, found + len(content)))
        at = found + len(content)
    return spans


# ---- event streams -----------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@router.get("/v1/fornax/events")
async def events(request: Request, request_id: str | None = None, model: str | None = None) -> Response:
    state, engine, viewer = _state(request), _engine(_model(request, model)), _viewer(request)
    if request_id is not None and not state.tenancy.may_see(viewer, request_id):
        # Not found, rather than forbidden: a user cannot tell others' ids from unknown ones.
        raise ApiError(
            404, f"no request {request_id!r} of this key is known", param="request_id", code="not_found"
        )

    async def stream() -> AsyncIterator[str]:
        # Subscribed here, not before the response: a generator that never starts would never
        # reach its `finally`, and a leaked subscription keeps the bus active for good.
        sub = engine.core.events.subscribe(request_id)
        try:
            yield ": subscribed\n\n"  # flushes the headers at once, so the client knows it is listening
            remaining: int | None = None  # sequences still running, once the `queued` event told n
            dropped, quiet_since = 0, time.monotonic()
            while not state.draining:  # a watcher must not hold a shutting-down server open
                try:
                    event = await asyncio.wait_for(sub.get(), 1.0)
                except TimeoutError:
                    if time.monotonic() - quiet_since > KEEPALIVE_S:
                        quiet_since = time.monotonic()
                        yield ": keepalive\n\n"
                    continue
                quiet_since = time.monotonic()
                if sub.dropped != dropped:
                    yield _sse({"type": "dropped", "count": sub.dropped - dropped})
                    dropped = sub.dropped
                payload = state.tenancy.event_for(viewer, event)
                if payload is None:  # another key's request
                    continue
                yield _sse(payload)
                if request_id is not None:
                    if event.type == "queued":
                        remaining = int(event.data.get("n", 1))
                    elif event.type == "finished":
                        remaining = (remaining or 1) - 1
                        if remaining <= 0:
                            return
        finally:
            sub.close()

    return sse_stream(stream())


@router.get("/v1/fornax/live")
async def live(
    request: Request, interval: float = 1.0, once: bool = False, model: str | None = None
) -> Response:
    served = _model(request, model)
    state, engine, stats = _state(request), _engine(served), served.live
    interval = min(max(interval, 0.2), 10.0)
    viewer = _viewer(request)
    if once:
        snapshot = state.tenancy.snapshot_for(viewer, await _snapshot(engine, stats))
        return Response(json.dumps(snapshot), media_type="application/json")

    async def stream() -> AsyncIterator[str]:
        while not state.draining:
            yield _sse(state.tenancy.snapshot_for(viewer, await _snapshot(engine, stats)))
            await asyncio.sleep(interval)

    return sse_stream(stream())


async def _snapshot(engine: AsyncEngine, stats: LiveStats) -> dict[str, Any]:
    out: dict[str, Any] = {"time": time.time(), **stats.summary()}
    if engine.dead_error is None:
        out.update(await engine.call(_queues))
    return out


def _queues(core: EngineCore) -> dict[str, Any]:
    """Read in the engine thread between steps, so the queues and the cache agree."""
    stats, sequences = core.stats(), core.sequences()
    running = [
        {
            "request_id": s.request_id,
            "num_computed_tokens": s.num_computed_tokens,
            "num_tokens": s.num_tokens,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_blocks": s.num_blocks,
        }
        for s in sequences
        if s.running
    ]
    waiting = [
        {"request_id": s.request_id, "num_prompt_tokens": s.num_prompt_tokens}
        for s in sequences
        if not s.running
    ]
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "running": running,
        "waiting": waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "num_blocks": stats.num_kv_blocks,
        "num_free_blocks": stats.num_free_kv_blocks,
        "block_size": stats.block_size,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "num_preemptions_total": stats.num_preemptions_total,
        "watchers": core.events.num_subscribers,
    }
