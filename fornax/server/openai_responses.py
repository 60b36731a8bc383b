"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is read into a chat turn (a `ChatCompletionRequest`: its input items become chat
messages, `instructions` a first system message, `text.format` the `response_format`,
`reasoning.effort` the `reasoning_effort`) and run by server/chat.py like any other; its output
is read apart by `ChatRun.splitter()` into output items: a `reasoning` item, a `message`, and
one `function_call` per call. Streamed and whole replies are built by the same `OutputBuilder`
from the same engine outputs (the whole reply reads them as a stream would, through
`run_to_end`'s `work`), so the two list the same items in the same order.

Kept responses (`store`, the default) live in server/response_store.py, per API key; what is
supported, and what is refused with a 400 naming the field, is listed in docs/usage.md ("OpenAI
Responses API").
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from fornax.server.auth import key_name
from fornax.server.chat import ChatRun, start_chat
from fornax.server.errors import ApiError, bad_request, validation_error
from fornax.server.generation import Choice
from fornax.server.limits import check_sampling_fields
from fornax.server.openai_format import stream_error
from fornax.server.protocol import ChatCompletionRequest
from fornax.server.response_store import ResponseStore, StoredResponse
from fornax.server.responses_output import OutputBuilder, OutputItem
from fornax.server.responses_protocol import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningInputItem,
    ResponsesRequest,
    TextPart,
)
from fornax.server.serving import parse_request, run_to_end, server_state, sse_stream
from fornax.tools.output import OutputSplitter
from fornax.tools.reasoning import opened_by_prompt

router = APIRouter()

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512  # OpenAI's bounds
# Chat fields that a 400 from the shared chat path may name -> the Responses field they came from.
_RENAMED = (
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
)


# ---- routes -----------------------------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, ResponsesRequest)
    _refuse_unsupported(req)
    key = key_name(request.state)
    previous = None
    if req.previous_response_id is not None:
        previous = state.responses.get(key, req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, param="previous_response_id")
    items = parse_input(req.input)
    history = previous.conversation() if previous is not None else []
    try:
        chat = _chat_request(req, to_messages(req.instructions, [*history, *items]))
        check_sampling_fields(chat, state.config, engine.model_config.vocab_size)
        request.state.cache_salt = chat.cache_salt  # the tenant's salt joins it (serving.start_generation)
        run = await start_chat(request, state, engine, chat, None, prefix="resp", endpoint="responses")
    except ApiError as exc:
        raise _renamed(exc) from None
    turn = Turn(req, model, run, previous, items)
    if req.stream:
        return sse_stream(_events(turn, state.responses, key))
    await run_to_end(request, run.gen, turn.read())
    body = turn.finish()
    turn.keep(state.responses, key)
    return JSONResponse(body)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    stored = server_state(request).responses.get(key_name(request.state), response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not server_state(request).responses.delete(key_name(request.state), response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    # Another key's response reads exactly as one never issued: ids reveal nothing across tenants.
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    return ApiError(404, f"no response with id {shown!r} found", param=param, code="not_found")


# ---- the request, read into a chat turn -------------------------------------------------------------


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for the fields whose meaning cannot be kept (docs/usage.md lists them, and why)."""
    refused = {
        "background": "background responses are not supported: send the request and wait, or stream it",
        "conversation": "conversation objects are not supported: continue with previous_response_id",
        "prompt": "stored prompt templates are not supported: send the input itself",
        "context_management": "context management (compaction) is not supported",
    }
    for name, why in refused.items():
        if getattr(req, name) not in (None, False, [], {}):
            raise bad_request(why, param=name)
    if req.include:
        raise bad_request(
            f"include values are not supported (got {req.include[0][:64]!r}): reasoning is "
            "always returned whole, and logprobs are not offered here",
            param="include",
        )
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: an input that does not fit is a 400", param="truncation"
        )
    if req.top_logprobs:
        raise bad_request(
            "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)", param="top_logprobs"
        )
    for name, value in (req.metadata or {}).items():
        if len(name) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys may have at most {MAX_METADATA_KEY} characters and values "
                f"{MAX_METADATA_VALUE}",
                param="metadata",
            )


def parse_input(value: str | list[dict[str, Any]]) -> list[BaseModel]:
    """`input` -> its items, each checked by its own model (a 400 names the item at fault)."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[BaseModel] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message" if "role" in raw else None)
        model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"input[{i}]: item type {_short(kind)} is not supported (supported: "
                f"{', '.join(INPUT_ITEMS)})",
                param=f"input.{i}.type",
            )
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            raise _located(validation_error(exc), f"input.{i}") from None
        parts = item.content if isinstance(item, MessageItem) else getattr(item, "output", None)
        if isinstance(parts, list):
            for j, part in enumerate(parts):
                if part.type not in TEXT_PARTS or part.text is None:
                    where = "content" if isinstance(item, MessageItem) else "output"
                    raise bad_request(
                        f"input[{i}]: only text content parts (input_text, output_text) are "
                        f"supported, got {_short(part.type)}",
                        param=f"input.{i}.{where}.{j}",
                    )
        items.append(item)
    return items


def to_messages(instructions: str | None, items: list[BaseModel]) -> list[dict[str, Any]]:
    """Items -> chat messages: a function call joins the assistant turn before it (or opens one),
    its output is a `tool` message, a reasoning item is left out, `developer` is `system`."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            assert isinstance(item, ReasoningInputItem)
    return messages


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text or "" for p in content)


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request is, field by field."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
        "user": req.user,
        "stream": req.stream,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "structured_outputs": req.structured_outputs,
        "chat_template_kwargs": req.chat_template_kwargs,
        "reasoning_effort": "high" if effort == "xhigh" else effort,  # the switch is on or off
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc) from None


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's nested ones; any other tool type is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: tool type {_short(kind)} is not supported: only function tools "
                "are (fornax runs no built-in tools)",
                param=f"tools.{i}.type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice of type {_short(choice.get('type'))} is not supported: use none, auto, "
            "required or {type: function, name}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _renamed(exc: ApiError) -> ApiError:
    """A 400 from the chat path, naming the Responses field instead of the chat one."""
    param = exc.param
    if param is None:
        return exc
    new = param
    if param.startswith("messages"):  # messages and input items do not line up one to one
        new = "input"
    elif param.startswith("tools.") and ".function." in param:
        new = param.replace(".function.", ".", 1)
    else:
        for old, name in _RENAMED:
            if param == old or param.startswith(old + "."):
                new = name + param[len(old) :]
                break
    exc.message = exc.message.replace(f"'{param}'", f"'{new}'").replace("'messages'", "'input'")
    exc.param = new
    return exc


def _located(exc: ApiError, where: str) -> ApiError:
    exc.param = f"{where}.{exc.param}" if exc.param else where
    exc.message = f"{where}: {exc.message}"
    return exc


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:64] + "..."


# ---- the answer ---------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One Responses request being answered: its output built as it comes, then the response."""

    req: ResponsesRequest
    model: str
    run: ChatRun
    previous: StoredResponse | None
    items: list[BaseModel]  # this request's input items (the conversation it adds)
    created_at: int = field(default_factory=lambda: int(time.time()))
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    body: dict[str, Any] | None = None  # the finished response
    id: str = field(init=False)  # resp_<hex>: the request id's hex (resp-<hex> in the logs)
    splitter: OutputSplitter = field(init=False)

    def __post_init__(self) -> None:
        self.splitter = self.run.splitter()
        self.id = "resp_" + self.run.gen.request_id.partition("-")[2]

    def feed(self, new_text: str, finished: bool, finish_reason: str | None) -> list[dict[str, Any]]:
        piece = self.splitter.feed(new_text)
        if finished:
            piece += self.splitter.finish()
        events = self.builder.feed(piece)
        if finished:
            events += self.builder.finish(finish_reason)
        return events

    async def read(self) -> None:
        """Build the whole reply from the engine outputs, as a stream would (no events sent)."""
        async for choice, out in self.run.gen.outputs():
            self.feed(out.new_text, out.finished, choice.finish_reason)

    def response(self, status: str, output: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        reasoning = {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": reasoning,
            "store": req.store,
            "temperature": req.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_unset=True) if fmt else {"type": "text"}
            },
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        } | more

    def finish(self) -> dict[str, Any]:
        """The finished response (every output read)."""
        gen = self.run.gen
        (choice,) = gen.choices
        reason = choice.finish_reason
        status = {"stop": "completed", "length": "incomplete"}.get(reason or "", "cancelled")
        details = {"reason": "max_output_tokens"} if reason == "length" else None
        reasoning_tokens = _reasoning_tokens(self.run, choice)
        usage = {
            "input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens},
            "output_tokens": gen.num_completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": gen.num_prompt_tokens + gen.num_completion_tokens,
        }
        output = [item.render() for item in self.builder.items]
        self.body = self.response(
            status, output, incomplete_details=details, usage=usage, fornax=gen.timings()
        )
        return self.body

    def keep(self, store: ResponseStore, key: str) -> None:
        """Store the finished response (unless `store: false`, or it was cancelled)."""
        if not self.req.store or self.body is None or self.body["status"] == "cancelled":
            return
        outputs = [_as_input(item) for item in self.builder.items]
        store.put(key, self.id, StoredResponse(self.body, [*self.items, *outputs], self.previous))


def _as_input(item: OutputItem) -> BaseModel:
    """An output item as the input item it is in the next turn's conversation."""
    if item.kind == "reasoning":
        return ReasoningInputItem(type="reasoning")
    if item.kind == "message":
        return MessageItem(role="assistant", content=[TextPart(type="output_text", text=item.text)])
    return FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.text)


def _reasoning_tokens(run: ChatRun, choice: Choice) -> int:
    """The output tokens spent reasoning: those up to and including the one that completes the
    end tag (all of them when the output was cut while reasoning), found by the tokens' bytes."""
    fmt = run.reasoning
    if fmt is None:
        return 0
    text = choice.text
    opened = fmt.starts_in_reasoning or opened_by_prompt(run.continued, fmt)
    if not opened and not text.lstrip().startswith(fmt.start):
        return 0
    at = text.find(fmt.end)
    if at < 0:
        return len(choice.token_ids)
    target, seen = len(text[: at + len(fmt.end)].encode()), 0
    for n, token_id in enumerate(choice.token_ids, start=1):
        seen += len(run.text(token_id)[1])
        if seen >= target:
            return n
    return len(choice.token_ids)


async def _events(turn: Turn, store: ResponseStore, key: str) -> AsyncIterator[str]:
    """The SSE stream: created, in_progress, the items' events, then completed (or incomplete);
    a failure after the first event is a `response.failed` event (the status line was sent)."""
    numbers = itertools.count()

    def sse(event: dict[str, Any]) -> str:
        event["sequence_number"] = next(numbers)
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    yield sse({"type": "response.created", "response": turn.response("in_progress", [])})
    yield sse({"type": "response.in_progress", "response": turn.response("in_progress", [])})
    try:
        async for choice, out in turn.run.gen.outputs():
            for event in turn.feed(out.new_text, out.finished, choice.finish_reason):
                yield sse(event)
        body = turn.finish()
        turn.keep(store, key)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield sse({"type": kind, "response": body})
    except Exception as exc:
        error = stream_error(exc)["error"]  # logs what is not the request's own fault
        code = "invalid_prompt" if isinstance(exc, ValueError) else "server_error"
        output = [item.render() for item in turn.builder.items]
        failed = turn.response("failed", output, error={"code": code, "message": error["message"]})
        yield sse({"type": "response.failed", "response": failed})
