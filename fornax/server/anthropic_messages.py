"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is translated into a chat completions request and run as one chat turn
(server/chat.py), so templates, tools, reasoning, constraints, admission, per-key limits and
metrics behave exactly as on /v1/chat/completions; the generation is labelled "messages".
What is served, what is refused and why is listed in docs/usage.md ("Anthropic Messages API").

The reply is built one way only: the engine's outputs are split (reasoning, answer text, tool
call fragments) and turned into Anthropic's stream events, one content block at a time. A
streamed reply sends those events; a whole reply is the same events accumulated. So the two
agree block for block, whatever order the model wrote text and calls in. Errors on these paths
take Anthropic's envelope (server/errors.py chooses it by path), mid-stream ones as an `error`
event.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fornax.engine.async_engine import EngineDeadError, RequestFailedError
from fornax.server.anthropic_protocol import (
    ContentBlock,
    MessageParam,
    MessagesCountTokensRequest,
    MessagesRequest,
    TextPart,
    ToolParam,
)
from fornax.server.chat import ChatRun, render_prompt, start_chat
from fornax.server.errors import ApiError, anthropic_error_body, bad_request
from fornax.server.limits import (
    check_sampling_fields,
    parse_model,
)
from fornax.server.protocol import ChatCompletionRequest
from fornax.server.serving import parse_request, run_to_end, sse_stream
from fornax.server.structured import tool_plan
from fornax.tools import ToolCallDelta
from fornax.tools.output import Piece

logger = logging.getLogger("fornax.server")
router = APIRouter()

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # what tools/prompt.py accepts for a function name
# Blocks of earlier assistant turns that are not put back into the prompt: Anthropic's thinking
# is never shown to the model again either, and fornax's signatures guard nothing (see _signature).
_DROPPED = frozenset({"thinking", "redacted_thinking"})


# ---- routes ------------------------------------------------------------------------------------------


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, MessagesRequest)
    chat = to_chat_request(req)
    check_sampling_fields(chat, state.config, engine.model_config.vocab_size)
    run = await start_chat(request, state, engine, chat, None, prefix="msg", endpoint="messages")
    events = message_events(run, model, req.stop_sequences or [])
    if req.stream:
        return sse_stream(_sse(events))
    message = _Accumulated()
    await run_to_end(request, run.gen, message.read(events))
    return JSONResponse(message.message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's token count, rendered as /v1/messages would render it."""
    state, engine, req, _ = await parse_request(request, MessagesCountTokensRequest)
    chat = to_chat_request(req)
    tools = tool_plan(chat, engine.tokenizer.chat_template, state.config.tool_call_parser)
    _, ids, _ = await render_prompt(state, engine, chat, tools)
    return {"input_tokens": len(ids)}


# ---- request: Messages -> chat completions --------------------------------------------------------


def to_chat_request(req: MessagesCountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request that asks for the same turn (400 naming the Messages field)."""
    if req.mcp_servers:
        raise bad_request(
            "'mcp_servers' (MCP connectors) is not supported by this server", param="mcp_servers"
        )
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    turns = [*_system(req.system), *_conversation(req.messages)]
    if not turns:  # the only message was an empty prefill
        raise bad_request("'messages' holds nothing to answer", param="messages")
    body: dict[str, Any] = {"model": req.model, "messages": turns}
    if turns[-1]["role"] == "assistant":  # a prefill: the reply continues it (and holds only the new text)
        body |= {"continue_final_message": True, "add_generation_prompt": False}
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs 'name'", param="tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        on = req.thinking.type == "enabled"
        body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}  # chat.THINKING_SWITCHES
    if isinstance(req, MessagesRequest):
        body |= {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stream": req.stream,
        }
        structured = req.structured_outputs
        if req.output_config is not None and req.output_config.format is not None:
            if structured is not None:
                raise bad_request(
                    "output_config.format and structured_outputs each constrain the output; send only one",
                    param="structured_outputs",
                )
            structured = {"json": req.output_config.format.json_schema}
        body["structured_outputs"] = structured
    return parse_model(ChatCompletionRequest, body)


def _system(system: str | list[TextPart] | None) -> list[dict[str, Any]]:
    if isinstance(system, list):
        system = "\n".join(_text_part(part, f"system.{i}") for i, part in enumerate(system))
    return [{"role": "system", "content": system}] if system else []


def _text_part(part: TextPart, where: str) -> str:
    if part.type != "text" or part.text is None:
        raise bad_request(
            f"{where}: only text blocks are supported here, got {part.type!r}", param=f"{where}.type"
        )
    return part.text


def _conversation(messages: list[MessageParam]) -> list[dict[str, Any]]:
    """Anthropic turns -> chat messages: a user turn's tool results become `tool` messages (in
    order, around its text), an assistant turn's tool uses become its `tool_calls`."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                if block.text is None:
                    raise bad_request(f"{where}.text is required", param=f"{where}.text")
                texts.append(block.text)
            elif block.type in _DROPPED and message.role == "assistant":
                continue
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append(_tool_call(block, where))
            elif block.type == "tool_result" and message.role == "user":
                if texts:  # text before a result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append(_tool_result(block, where))
            elif block.type in ("text", "tool_use", "tool_result", *_DROPPED):
                raise bad_request(
                    f"{where}: a {block.type} block cannot be in a {message.role} message",
                    param=f"{where}.type",
                )
            else:
                raise bad_request(
                    f"{where}: {block.type!r} blocks are not supported by this server (text, "
                    "tool_use, tool_result and thinking are)",
                    param=f"{where}.type",
                )
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "\n".join(texts)})
    last = out[-1]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise bad_request(
                "the final assistant message (a prefill the reply continues) may hold text only",
                param=f"messages.{len(messages) - 1}.content",
            )
        if not last["content"].strip():  # nothing to continue: an ordinary new turn
            out.pop()
    return out


def _tool_call(block: ContentBlock, where: str) -> dict[str, Any]:
    if not block.id or not block.name:
        raise bad_request(f"{where}: a tool_use block needs 'id' and 'name'", param=where)
    arguments = json.dumps(block.input or {}, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _tool_result(block: ContentBlock, where: str) -> dict[str, Any]:
    if not block.tool_use_id:
        raise bad_request(f"{where}.tool_use_id is required", param=f"{where}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{where}.content.{k}") for k, part in enumerate(content))
    text = content or ""
    if block.is_error:  # the model is told the call failed; it sees no flag otherwise
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _tool(i: int, tool: ToolParam) -> dict[str, Any]:
    where = f"tools.{i}"
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"{where}: server tools ({tool.type!r}) are not supported by this server; only client "
            "tools (name, description, input_schema) are",
            param=f"{where}.type",
        )
    if not _TOOL_NAME.fullmatch(tool.name):
        raise bad_request(
            f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {tool.name!r}",
            param=f"{where}.name",
        )
    if tool.input_schema is None:
        raise bad_request(f"{where}.input_schema is required", param=f"{where}.input_schema")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


# ---- reply: engine outputs -> Anthropic's events -----------------------------------------------------


async def message_events(
    run: ChatRun, model: str, stop_sequences: list[str]
) -> AsyncGenerator[dict[str, Any], None]:
    """The reply as Anthropic's stream events (dicts, each with its `type`)."""
    gen = run.gen
    head = {"id": _message_id(gen.request_id), "type": "message", "role": "assistant", "model": model}
    start_usage = {
        "input_tokens": gen.num_prompt_tokens,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    yield {
        "type": "message_start",
        "message": head | {"content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage},
    }
    splitter = run.splitter()
    blocks = _Blocks()
    finish_reason: str | None = None
    matched: int | str | None = None
    async with contextlib.aclosing(gen.outputs()) as outputs:
        async for choice, out in outputs:
            piece = splitter.feed(out.new_text)
            if out.finished:
                piece += splitter.finish()
                finish_reason, matched = choice.finish_reason, out.stop_reason
            for event in blocks.feed(piece):
                yield event
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop_reason(finish_reason, matched, splitter.called, stop_sequences)
    cached = gen.num_cached_tokens
    # Anthropic counts prompt tokens read from the cache apart from input_tokens (their sum is the
    # prompt); the engine's prefix cache is the cache read here, and nothing is "written" at a cost.
    usage = {
        "input_tokens": gen.num_prompt_tokens - cached,
        "output_tokens": gen.num_completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage,
    }
    yield {"type": "message_stop"}


def _message_id(request_id: str) -> str:
    """The request id ("msg-<hex>": logs, usage, the visualizer) in Anthropic's spelling, msg_<hex>."""
    return request_id.replace("-", "_", 1)


def _stop_reason(
    finish_reason: str | None, matched: int | str | None, called: bool, stop_sequences: list[str]
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from how the engine ended the sequence."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":  # aborted: only while the server gives up on it (draining)
        raise ApiError(503, "the request was ended before it finished: the server is shutting down")
    if called:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


class _Blocks:
    """Split pieces -> content block events: one block open at a time, indexes 0, 1, 2, ...

    A thinking or text block opens on its first text that is not only whitespace (whitespace
    before it is held and goes in with it), so blank text between tool calls makes no block."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.held = ""  # whitespace waiting for a block of kind `held_kind`
        self.held_kind: str | None = None
        self.thinking: list[str] = []  # the open thinking block's text, for its signature
        self.call = -1  # the open tool_use block's call index (the parser's)

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        # A piece keeps its parts apart, not their order; in the text the reasoning comes first,
        # then the rest of a call already open, then answer text, then calls that start here.
        calls = piece.calls
        new = next((i for i, call in enumerate(calls) if call.id is not None), len(calls))
        return (
            self._text("thinking", piece.reasoning)
            + self._calls(calls[:new])
            + self._text("text", piece.content)
            + self._calls(calls[new:])
        )

    def _calls(self, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for call in calls:
            if call.id is not None:  # a call's first fragment: a new tool_use block
                tool_id = "toolu_" + call.id.removeprefix("call_")
                events += self._open({"type": "tool_use", "id": tool_id, "name": call.name, "input": {}})
                self.call = call.index
            if call.arguments and self.kind == "tool_use" and self.call == call.index:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.kind == "thinking":
            events.append(
                self._delta({"type": "signature_delta", "signature": _signature("".join(self.thinking))})
            )
        if self.kind is not None:
            events.append({"type": "content_block_stop", "index": self.index})
        self.kind = None
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        delta_type, field = ("thinking_delta", "thinking") if kind == "thinking" else ("text_delta", "text")
        if self.kind != kind:
            if self.held_kind != kind:
                self.held, self.held_kind = "", kind
            if not (self.held + text).strip():
                self.held += text
                return []
            text, self.held, self.held_kind = self.held + text, "", None
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events = self._open(block)
        else:
            events = []
        if kind == "thinking":
            self.thinking.append(text)
        return [*events, self._delta({"type": delta_type, field: text})]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.kind, self.thinking = block["type"], []
        self.held, self.held_kind = "", None
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def _signature(thinking: str) -> str:
    """A thinking block's `signature`, which Anthropic's clients require. Anthropic's is an
    encrypted check that lets it verify thinking sent back; fornax drops thinking sent back
    from the prompt, so there is nothing to verify. It is the SHA-256 of the thinking text: the
    same for a streamed and a whole reply, and no secret (docs/usage.md)."""
    return "sha256:" + hashlib.sha256(thinking.encode()).hexdigest()


class _Accumulated:
    """A whole reply: the events read into the message they describe."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self._json: dict[int, str] = {}  # a tool_use block's input JSON, as streamed

    async def read(self, events: AsyncGenerator[dict[str, Any], None]) -> None:
        async with contextlib.aclosing(events):
            async for event in events:
                self._add(event)

    def _add(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "message_start":
            self.message = event["message"]
        elif kind == "content_block_start":
            self.message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = self.message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                self._json[event["index"]] = self._json.get(event["index"], "") + delta["partial_json"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                field = "thinking" if delta["type"] == "thinking_delta" else "text"
                block[field] += delta[field]
        elif kind == "content_block_stop" and event["index"] in self._json:
            self.message["content"][event["index"]]["input"] = _input_object(self._json.pop(event["index"]))
        elif kind == "message_delta":
            self.message.update(event["delta"])
            self.message["usage"] = event["usage"]


def _input_object(text: str) -> dict[str, Any]:
    """A tool_use block's input: its arguments JSON, or {} when it is not a whole object (the
    reply was cut off by max_tokens mid-call)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ---- streaming ------------------------------------------------------------------------------------------


async def _sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    """Anthropic's SSE framing (`event: <type>` before each data line); a failure ends the
    stream with an `error` event in Anthropic's envelope."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as exc:
            yield f"event: error\ndata: {json.dumps(_stream_error(exc))}\n\n"


def _stream_error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, ApiError):
        return anthropic_error_body(exc.status, exc.message)
    if isinstance(exc, ValueError):
        return anthropic_error_body(400, str(exc))
    if isinstance(exc, RequestFailedError):  # the engine logged it; this request alone ended
        return anthropic_error_body(500, "internal error while generating this request; it was ended")
    if isinstance(exc, EngineDeadError):
        return anthropic_error_body(503, f"the engine has stopped: {exc}")
    logger.exception("error while streaming")
    return anthropic_error_body(500, "internal server error")
