"""HTTP routes: parse and bound a request, hand it to the async engine, shape the answer.

No scheduling logic lives here: admission (queued requests and sequences, the per-request
token budget, priorities: server/admission.py) and per-key limits (server/tenancy.py) are
checks before the engine sees a request; everything else is the engine's. Authentication,
loading and draining are handled before routing (auth.Gate); bodies are read and parsed by
server/body_parser.py.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from fornax import __version__
from fornax.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from fornax.engine.core import EngineCore
from fornax.engine.request import SamplingParams
from fornax.server.admission import admit
from fornax.server.auth import key_name, key_role
from fornax.server.body_parser import parse_body
from fornax.server.errors import ApiError, bad_request
from fornax.server.generation import ClientGone, Generation, unless_disconnected
from fornax.server.limits import (
    build_sampling_params,
    check_messages,
    check_prompts,
    check_sampling_fields,
    check_text_fits,
    check_token_count,
    check_token_ids,
    check_tokenize_input,
    message_texts,
    num_logprobs,
    resolve_max_tokens,
)  # fmt: skip
from fornax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)  # fmt: skip
from fornax.server.responses import (
    TokenText,
    chat_completion,
    chat_stream,
    collect,
    completion,
    completion_stream,
)  # fmt: skip
from fornax.server.state import ServerState
from fornax.server.structured import compile_constraint, constraint_of, tool_plan
from fornax.tools import prepare_messages

# The two generation request shapes; _parse_generation_request returns the one it was given.
_Req = TypeVar("_Req", ChatCompletionRequest, CompletionRequest)
_M = TypeVar("_M", ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)

router = APIRouter()
CLIENT_CLOSED = 499  # nginx's status for "client closed request": never seen by the client


def _state(request: Request) -> ServerState:
    return request.app.state.fornax


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# ---- health and metadata ---------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.ready:
        return JSONResponse({"status": "ok"})
    if state.engine_error is not None:  # before draining: a dead engine drains on its way out
        status, message = "engine_dead", f"the engine has stopped: {state.engine_error}"
    else:
        status = "draining" if state.draining else "error" if state.load_error else "loading"
        message = {"draining": "the server is shutting down", "loading": "the model is still loading"}.get(
            status, f"the model failed to load: {state.load_error}"
        )
    return ApiError(503, message, code=status, headers={"Retry-After": "1"}).response()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    cards = []
    for model in state.models.models:
        # a model not loaded (yet, or any more) has no engine to say its context length
        max_len = (
            model.engine.max_model_len
            if model.engine is not None
            else model.config.engine.scheduler.max_model_len
        )
        cards += [
            ModelCard(
                id=name,
                created=int(state.started_at),
                max_model_len=max_len,
                deterministic=model.config.engine.deterministic,
                kernels=model.engine.kernels if model.engine is not None else None,
            )
            for name in model.config.names
        ]
    return _json(ModelList(data=cards))


# ---- generation --------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, engine, req, model, k = await _parse_generation_request(request, ChatCompletionRequest)
    vocab = engine.model_config.vocab_size
    tools = tool_plan(req, engine.tokenizer.chat_template, state.config.tool_call_parser)
    constraint = constraint_of(req, tools)
    messages = check_messages(req.messages, state.config)
    check_text_fits(message_texts(messages), engine.max_model_len, "messages")
    # Templates without tool support get the tools and the tool turns as text (tools/prompt.py).
    messages = prepare_messages(messages, tools.tools, tools.template_supports_tools)
    template_tools = tools.tools if tools.template_supports_tools else None
    try:
        ids = await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages,
                                      add_generation_prompt=True, tools=template_tools, tokenize=True)  # fmt: skip
    except ValueError as exc:  # ChatTemplateError: missing, broken or over-budget template
        raise bad_request(str(exc), param="messages") from None
    assert isinstance(ids, list)
    use_new = req.max_completion_tokens is not None
    max_tokens = resolve_max_tokens(req.max_completion_tokens if use_new else req.max_tokens, len(ids),
                                    engine.max_model_len, state.config,
                                    "max_completion_tokens" if use_new else "max_tokens")  # fmt: skip
    if constraint is not None:
        await compile_constraint(engine.compile_grammar, constraint)
    params = build_sampling_params(req, max_tokens, k, vocab, constraint)
    gen = _generation(state, request, engine, "chatcmpl", "chat", [ids], params, req.priority, req.stream)
    text = TokenText(engine.tokenizer)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_stream(chat_stream(gen, model, k, text, include_usage, tools))
    await _run(request, gen)
    return _json(chat_completion(gen, model, k, text, tools))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state, engine, req, model, k = await _parse_generation_request(request, CompletionRequest)
    vocab = engine.model_config.vocab_size
    for name in ("tools", "tool_choice"):
        if getattr(req, name) not in (None, [], "none"):
            raise bad_request(f"'{name}' is a chat completions feature (/v1/chat/completions)", param=name)
    constraint = constraint_of(req)
    prompts = check_prompts(req.prompt, state.config)
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        check_text_fits([text], engine.max_model_len, "prompt")
    encoded = iter(await asyncio.to_thread(engine.tokenizer.encode_batch, texts) if texts else [])
    prompt_ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
    await asyncio.to_thread(_check_prompt_ids, prompt_ids, vocab)  # up to 4 MiB of ids: off the loop
    longest = max(prompt_ids, key=len)
    max_tokens = resolve_max_tokens(req.max_tokens, len(longest), engine.max_model_len, state.config,
                                    "max_tokens")  # fmt: skip
    if constraint is not None:
        await compile_constraint(engine.compile_grammar, constraint)
    params = build_sampling_params(req, max_tokens, k, vocab, constraint)
    echo = [p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts] if req.echo else None  # fmt: skip
    gen = _generation(
        state, request, engine, "cmpl", "completions", prompt_ids, params, req.priority, req.stream
    )
    text = TokenText(engine.tokenizer)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_stream(completion_stream(gen, model, k, text, echo, include_usage))
    await _run(request, gen)
    return _json(completion(gen, model, k, text, echo))


def _check_prompt_ids(prompt_ids: list[list[int]], vocab: int) -> None:
    for ids in prompt_ids:
        check_token_ids(ids, vocab, "prompt")
        if not ids:
            raise bad_request("the prompt must contain at least one token", param="prompt")


async def _parse_generation_request(
    request: Request, model_cls: type[_Req]
) -> tuple[ServerState, AsyncEngine, _Req, str, int]:
    """What both generation routes do first: read and validate the body, check the model and
    the sampling fields. Returns (state, engine, parsed request, served model name, top logprobs)."""
    state, engine, req, model = await _parse_request(request, model_cls)
    check_sampling_fields(req, state.config, engine.model_config.vocab_size)
    request.state.cache_salt = req.cache_salt  # for _generation: the tenant's salt joins it
    return state, engine, req, model, num_logprobs(req, state.config)


async def _parse_request(request: Request, model_cls: type[_M]) -> tuple[ServerState, AsyncEngine, _M, str]:
    """Every model route starts here: a bounded body parsed into `model_cls`, the model it
    names, and that model's engine (loaded if it was not: server/model_set.py), held until the
    response ends. Returns (state, engine, parsed request, the name the request used)."""
    state = _state(request)
    req = await parse_body(request, model_cls, state.config.max_body_bytes)  # big bodies: another process
    model = state.models.find(req.model)
    engine = await state.models.lease(model, request.scope.setdefault("state", {}))
    request.state.served_model = model.name
    return state, engine, req, req.model or model.name


def _generation(
    state: ServerState, request: Request, engine: AsyncEngine, prefix: str, endpoint: str, prompts: list[list[int]],
    params: SamplingParams, priority: int, stream: bool,
) -> Generation:  # fmt: skip
    key = key_name(request.state)
    admit(state, prompts, params, priority, key, key_role(request.state))
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    tenancy = state.tenancy
    tenancy.admit(key, request_id, prompts, params, engine.max_model_len)  # per-key limits: 429
    salt = tenancy.cache_salt(key, getattr(request.state, "cache_salt", None))
    return Generation(state, request_id, endpoint, key, prompts, params, priority, stream, engine,
                      request.state.served_model, cache_salt=salt)  # fmt: skip


async def _run(request: Request, gen: Generation) -> None:
    """Run a non-streaming generation to the end, unless the client leaves first."""
    try:
        await unless_disconnected(request, collect(gen))
    except ClientGone:
        raise _ClientClosed from None
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


class _ClientClosed(ApiError):
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


# ---- tokenizer ---------------------------------------------------------------------------------------


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state, engine, req, _ = await _parse_request(request, TokenizeRequest)
    max_len = engine.max_model_len
    messages, param = check_tokenize_input(req, state.config, max_len)
    try:
        if messages is not None:
            ids = await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages,
                                          add_generation_prompt=req.add_generation_prompt, tokenize=True)  # fmt: skip
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    check_token_count(ids, max_len, param)
    return {"tokens": ids, "count": len(ids), "max_model_len": max_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    _, engine, req, _ = await _parse_request(request, DetokenizeRequest)
    check_token_count(req.tokens, engine.max_model_len, "tokens")
    check_token_ids(req.tokens, engine.model_config.vocab_size, "tokens")
    return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}


# ---- admin -------------------------------------------------------------------------------------------


@router.get("/admin/usage")
async def admin_usage(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "object": "usage",
        "keys": state.tenancy.usage({name: asdict(u) for name, u in state.usage.items()}),
    }


@router.get("/admin/state")
async def admin_state(request: Request) -> dict[str, Any]:
    state = _state(request)
    out: dict[str, Any] = {
        "ready": state.ready, "draining": state.draining, "loading": state.engine is None,
        "inflight_requests": len(state.inflight), "queued_requests": state.num_queued,
        "aborted_requests": state.num_aborted, "rejected_queue_full": state.num_rejected_queue_full,
    }  # fmt: skip
    if state.engine is not None and state.engine.dead_error is None:  # the first model's, at top level
        out.update(await state.engine.call(_engine_snapshot))
        out["engine_streams"] = state.engine.num_unfinished
    models = []
    for model in state.models.models:
        entry: dict[str, Any] = {"name": model.name, "loaded": model.engine is not None,
                                 "loading": model.loading is not None, "leases": model.leases,
                                 "load_error": model.load_error}  # fmt: skip
        if model.engine is not None and model.engine.dead_error is None:
            entry.update(await model.engine.call(_engine_snapshot))
            entry["engine_streams"] = model.engine.num_unfinished
        models.append(entry)
    out["models"] = models
    return out


@router.get("/admin/memory")
async def admin_memory(request: Request, model: str | None = None) -> dict[str, Any]:
    """The process's resident memory by owner (engine/memory_report.py) as `model`'s engine (default:
    the first) sees it, read between its steps."""
    engine = _state(request).models.find(model).engine
    if engine is None or engine.dead_error is not None:
        raise ApiError(503, "the engine is not running", code="engine_unavailable")
    report = await engine.call(lambda core: core.memory_report())
    return {"object": "memory", **report.as_dict()}


def _engine_snapshot(core: EngineCore) -> dict[str, Any]:
    """Read in the engine thread, between steps, so the numbers agree with each other."""
    try:
        core.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"broken: {exc}"
    stats = core.stats()
    return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage, "kv_integrity": integrity}  # fmt: skip
