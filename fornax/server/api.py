"""HTTP routes: parse and bound a request, hand it to the async engine, shape the answer.

No scheduling logic lives here: admission (queued requests and sequences, the per-request
token budget, priorities: server/admission.py) and per-key limits (server/tenancy.py) are
checks before the engine sees a request; everything else is the engine's. Authentication,
loading and draining are handled before routing (auth.Gate); bodies are read and parsed by
server/body_parser.py; what every generation route shares is server/serving.py, and a chat
turn (for chat completions, Responses and Messages alike) is server/chat.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fornax import __version__
from fornax.engine.async_engine import AsyncEngine
from fornax.engine.core import EngineCore
from fornax.server.chat import start_chat
from fornax.server.errors import ApiError, bad_request
from fornax.server.limits import (
    build_sampling_params,
    check_prompts,
    check_sampling_fields,
    check_text_fits,
    check_token_count,
    check_token_ids,
    check_tokenize_input,
    num_logprobs,
    resolve_max_tokens,
)
from fornax.server.openai_format import TokenText, chat_completion, chat_stream, completion, completion_stream
from fornax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from fornax.server.serving import (
    json_response,
    parse_request,
    require_generation,
    routes_of,
    run_to_end,
    server_state,
    sse_stream,
    start_generation,
)
from fornax.server.state import ServerState
from fornax.server.structured import compile_constraint, constraint_of

# The two generation request shapes; _parse_generation_request returns the one it was given.
_Req = TypeVar("_Req", ChatCompletionRequest, CompletionRequest)

router = APIRouter()


# ---- health and metadata ---------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    state = server_state(request)
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
    state = server_state(request)
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
                endpoints=routes_of(model.engine) if model.engine is not None else None,
            )
            for name in model.config.names
        ]
    for name, model in state.models.adapters.items():
        adapter = (
            model.engine.core.lora.registry.get(name) if model.engine and model.engine.core.lora else None
        )
        cards.append(
            ModelCard(
                id=name,
                created=int(state.started_at),
                parent=model.name,
                root=adapter.path if adapter is not None else None,
                max_model_len=model.engine.max_model_len if model.engine else None,
            )
        )
    return json_response(ModelList(data=cards))


# ---- generation --------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, engine, req, model, k = await _parse_generation_request(request, ChatCompletionRequest)
    run = await start_chat(request, state, engine, req, k)
    if req.stream:
        return sse_stream(chat_stream(run, model, k, req.stream_options))
    await run_to_end(request, run.gen)
    return json_response(chat_completion(run, model, k))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state, engine, req, model, k = await _parse_generation_request(request, CompletionRequest)
    require_generation(engine, model)
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
    max_tokens = resolve_max_tokens(
        req.max_tokens, len(longest), engine.max_model_len, state.config, "max_tokens"
    )
    if constraint is not None:
        await compile_constraint(engine.compile_grammar, constraint)
    params = build_sampling_params(req, max_tokens, k, vocab, constraint)
    echo = (
        [p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        if req.echo
        else None
    )
    gen = start_generation(
        state, request, engine, "cmpl", "completions", prompt_ids, params, req.priority, req.stream
    )
    gen.prompt_logprobs_shown = req.prompt_logprobs
    text = TokenText(engine.tokenizer)
    if req.stream:
        return sse_stream(completion_stream(gen, model, k, text, echo, req.stream_options))
    await run_to_end(request, gen)
    return json_response(completion(gen, model, k, text, echo))


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
    state, engine, req, model = await parse_request(request, model_cls)
    check_sampling_fields(req, state.config, engine.model_config.vocab_size)
    request.state.cache_salt = req.cache_salt  # for _generation: the tenant's salt joins it
    return state, engine, req, model, num_logprobs(req, state.config)


# ---- tokenizer ---------------------------------------------------------------------------------------


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state, engine, req, _ = await parse_request(request, TokenizeRequest)
    max_len = engine.max_model_len
    messages, param = check_tokenize_input(req, state.config, max_len)
    try:
        if messages is not None:
            ids = await asyncio.to_thread(
                engine.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tokenize=True,
            )
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    check_token_count(ids, max_len, param)
    return {"tokens": ids, "count": len(ids), "max_model_len": max_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    _, engine, req, _ = await parse_request(request, DetokenizeRequest)
    check_token_count(req.tokens, engine.max_model_len, "tokens")
    check_token_ids(req.tokens, engine.model_config.vocab_size, "tokens")
    return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}


# ---- admin -------------------------------------------------------------------------------------------


@router.get("/admin/usage")
async def admin_usage(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {
        "object": "usage",
        "keys": state.tenancy.usage({name: asdict(u) for name, u in state.usage.items()}),
    }


@router.get("/admin/state")
async def admin_state(request: Request) -> dict[str, Any]:
    state = server_state(request)
    out: dict[str, Any] = {
        "ready": state.ready,
        "draining": state.draining,
        "loading": state.engine is None,
        "inflight_requests": len(state.inflight),
        "queued_requests": state.num_queued,
        "aborted_requests": state.num_aborted,
        "rejected_queue_full": state.num_rejected_queue_full,
    }
    if state.engine is not None and state.engine.dead_error is None:  # the first model's, at top level
        out.update(await state.engine.call(_engine_snapshot))
        out["engine_streams"] = state.engine.num_unfinished
    models = []
    for model in state.models.models:
        entry: dict[str, Any] = {
            "name": model.name,
            "loaded": model.engine is not None,
            "loading": model.loading is not None,
            "leases": model.leases,
            "load_error": model.load_error,
        }
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
    engine = server_state(request).models.find(model).engine
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
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "kv_integrity": integrity,
    }
