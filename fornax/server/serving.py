"""What every generation route does around its own request shape: read and bound the body,
lease the named model's engine, admit the work, run it to the end or stream it.

The chat, completions, Responses and Messages routes (server/api.py, server/chat.py,
server/openai_responses.py, server/anthropic_messages.py) differ only in how they read their request and
shape their answer; everything here is shared so that admission, per-key limits, the prefix
cache salt, disconnects and engine failures behave alike on all of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from fornax.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from fornax.engine.pooling import PoolingParams
from fornax.engine.request import SamplingParams
from fornax.server.admission import admit
from fornax.server.auth import key_name, key_role
from fornax.server.body_parser import parse_body
from fornax.server.errors import ApiError, bad_request
from fornax.server.generation import ClientGone, Generation, unless_disconnected
from fornax.server.openai_format import collect
from fornax.server.state import ServerState

M = TypeVar("M", bound=BaseModel)
CLIENT_CLOSED = 499  # nginx's status for "client closed request": never seen by the client


def server_state(request: Request) -> ServerState:
    return request.app.state.fornax


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


async def parse_request(request: Request, model_cls: type[M]) -> tuple[ServerState, AsyncEngine, M, str]:
    """Every model route starts here: a bounded body parsed into `model_cls` (which has a
    `model` field), the model it names, and that model's engine (loaded if it was not:
    server/model_set.py), held until the response ends. Returns (state, engine, parsed
    request, the name the request used)."""
    state = server_state(request)
    req = await parse_body(request, model_cls, state.config.max_body_bytes)  # big bodies: another process
    name = getattr(req, "model", None)
    model = state.models.find(name)
    engine = await state.models.lease(model, request.scope.setdefault("state", {}))
    request.state.served_model = model.name
    # A LoRA adapter's name: the request runs on its base model's engine, with the adapter.
    request.state.lora = name if name in state.models.adapters else None
    return state, engine, req, name or model.name


# What a model serves (its /v1/models card says so): an encoder embeds only, and a
# cross-encoder (a classifier head: server/embeddings.py) scores pairs only.
EMBEDDING_ROUTES = ("embeddings", "rerank", "score")
GENERATION_ROUTES = ("chat", "completions", "responses", "messages")
CROSS_ENCODER_ROUTES = ("rerank", "score")


def routes_of(engine: AsyncEngine) -> list[str]:
    if engine.model_config.pooling.cross_encoder:
        return list(CROSS_ENCODER_ROUTES)
    return list(EMBEDDING_ROUTES if engine.model_config.encoder else GENERATION_ROUTES + EMBEDDING_ROUTES)


def require_generation(engine: AsyncEngine, model: str) -> None:
    """400 for a generation request to a model that only embeds (or only scores pairs)."""
    if engine.model_config.pooling.cross_encoder:
        raise bad_request(
            f"the model '{model}' is a cross-encoder: it serves /v1/rerank and /v1/score, not generation",
            param="model",
            code="model_not_generative",
        )
    if engine.model_config.encoder:
        raise bad_request(
            f"the model '{model}' is an embedding model: it serves /v1/embeddings, /v1/rerank "
            "and /v1/score, not generation",
            param="model",
            code="model_not_generative",
        )


def start_generation(
    state: ServerState,
    request: Request,
    engine: AsyncEngine,
    prefix: str,
    endpoint: str,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    stream: bool,
    pooling: PoolingParams | list[PoolingParams] | None = None,
) -> Generation:
    """Admit the work (queue bounds, then the key's limits: 429s) and make its Generation;
    `endpoint` labels it in metrics, usage and the visualizer. `pooling`: embedding requests,
    admitted as `params` (one sequence of one token per prompt)."""
    key = key_name(request.state)
    admit(state, prompts, params, priority, key, key_role(request.state))
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    tenancy = state.tenancy
    tenancy.admit(key, request_id, prompts, params, engine.max_model_len)  # per-key limits: 429
    salt = tenancy.cache_salt(key, getattr(request.state, "cache_salt", None))
    return Generation(
        state,
        request_id,
        endpoint,
        key,
        prompts,
        params,
        priority,
        stream,
        engine,
        request.state.served_model,
        cache_salt=salt,
        pooling=pooling,
        lora=getattr(request.state, "lora", None),
    )


async def run_to_end(request: Request, gen: Generation, work: Awaitable[Any] | None = None) -> None:
    """Run a non-streaming generation to the end, unless the client leaves first. `work`, when
    given, is what reads `gen`'s outputs instead of a plain collect (Messages builds its content
    blocks from them as it would stream them: server/anthropic_messages.py)."""
    try:
        await unless_disconnected(request, collect(gen) if work is None else work)
    except ClientGone:
        raise ClientClosed from None
    except EngineDeadError as exc:
        raise ApiError(503, f"the engine has stopped: {exc}", code="engine_dead") from None
    except RequestFailedError:  # logged with its traceback by the engine; the details stay there
        raise ApiError(
            500,
            "internal error while generating this request; it was ended, and the server goes on serving",
            code="internal_error",
        ) from None
    except ValueError as exc:  # the engine refused the request (e.g. the KV cache is too small for it)
        raise bad_request(str(exc)) from None


class ClientClosed(ApiError):
    def __init__(self) -> None:
        super().__init__(CLIENT_CLOSED, "client closed the request")


class SSEResponse(StreamingResponse):
    """A stream whose generator is always closed when the response ends: a client that goes
    away while a chunk is being sent would otherwise leave it suspended (and its request
    running) until garbage collection."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse_stream(chunks: Any) -> StreamingResponse:
    """A server-sent-events response over `chunks` (formatted SSE messages); the API routes and
    the visualizer's event streams share it."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SSEResponse(chunks, media_type="text/event-stream", headers=headers)
