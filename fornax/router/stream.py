"""Relaying a replica's server-sent events, and the commit point that makes failover safe.

Before the commit point nothing has been sent to the client, so a failing replica costs
only a retry on another one. The commit point is the first event that carries something
the client must not see twice or from two replicas: content, a finish reason, usage, an
error the client should get, or [DONE]. Events that carry nothing but the assistant role
(a chat stream's opening chunk, sent as soon as a replica admits the request, before it is
even scheduled) are held back until then, so a request queued on a replica that dies
fails over as if it had never been sent. An error event from the replica before the
commit point (its engine stopped, say) is a failed attempt like a 5xx.

After the commit point the relay forwards whole events as they arrive (one search for the
last event boundary per chunk), never part of one. If the replica fails or closes the stream
before its last event, the incomplete tail is dropped and the stream ends with an error event:
the client never gets a chunk the replica did not finish, and in particular no finish_reason
it did not send.

Each API frames its stream its own way (`StreamFormat`): chat and completions end with
`data: [DONE]` and open with role-only chunks; OpenAI's Responses names its events
(`event: response.created` ... `response.completed`) and Anthropic's Messages too
(`message_start` ... `message_stop`). What is held, what ends a stream and the error event a
broken one ends with follow the format.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from fornax.router.upstream import ClientError
from fornax.server.errors import anthropic_error_body, error_body

DONE_EVENT = b"data: [DONE]\n\n"
HOLD, COMMIT, NOT_READY, SERVER_ERROR = "hold", "commit", "not_ready", "server_error"
# Relay outcomes (a metrics label).
OK, STREAM_ERROR, CLIENT_GONE = "ok", "stream_error", "client_gone"
DRAIN_TIMEOUT_S = 1.0


class Truncated(Exception):
    """The replica ended the stream without its `data: [DONE]`."""


@dataclass
class Opened:
    """A stream past its commit point: what to send first, and where to go on from."""

    first: bytes  # whole events: the held ones, then the committing one and any after it
    rest: bytes  # the start of an event not complete yet
    chunks: AsyncIterator[bytes]
    done: bool  # `first` already ends with [DONE]


@dataclass
class NotOpened:
    kind: str  # NOT_READY, SERVER_ERROR, or "transport_error" (ended before the commit point)
    message: str


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Whole events (each with its blank line) and the incomplete rest."""
    parts = buf.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]], parts[-1]


def event_data(event: bytes) -> bytes | None:
    """The data of an event (its `data:` lines joined), None for a comment-only event."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def event_name(event: bytes) -> bytes | None:
    """The `event:` field of an event (Responses and Messages name theirs), None without one."""
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip()
    return None


def _json_data(event: bytes) -> dict[str, Any] | None:
    data = event_data(event)
    try:
        obj = json.loads(data) if data is not None and data != b"[DONE]" else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class StreamFormat:
    """Chat completions' and completions' framing: `data:` events, `data: [DONE]` last."""

    def classify(self, event: bytes) -> str:
        """HOLD, COMMIT, NOT_READY or SERVER_ERROR for an event seen before the commit point."""
        data = event_data(event)
        if data is None:
            return HOLD
        obj = _json_data(event)
        if obj is None:
            return COMMIT  # [DONE], or not ours to judge: the client gets it as the replica sent it
        error = obj.get("error")
        if isinstance(error, dict):
            return _error_verdict(error.get("type"), not_ready="service_unavailable", server="server_error")
        choices = obj.get("choices")
        if (
            isinstance(choices, list)
            and choices
            and obj.get("usage") is None
            and all(map(_role_only, choices))
        ):
            return HOLD
        return COMMIT

    def ends(self, out: bytes) -> bool:
        """Whether `out` (whole events) ends with the stream's last event."""
        return out.endswith(DONE_EVENT)

    def error_event(self, message: str, last: bytes) -> bytes:
        """The event a broken stream ends with; `last`: the last whole event relayed."""
        body = error_body(message, "server_error", code="replica_failed")
        return b"data: " + json.dumps(body).encode() + b"\n\n" + DONE_EVENT


class ResponsesFormat(StreamFormat):
    """OpenAI's Responses: named events numbered by `sequence_number`, the last one
    `response.completed`, `response.incomplete`, `response.failed` or `error`."""

    HELD = frozenset({b"response.created", b"response.in_progress"})
    LAST = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"error"})

    def classify(self, event: bytes) -> str:
        name = event_name(event)
        if name is None or name in self.HELD:
            return HOLD
        if name == b"response.failed":  # before any output: the replica's failure, or the request's
            error = ((_json_data(event) or {}).get("response") or {}).get("error") or {}
            return SERVER_ERROR if error.get("code") == "server_error" else COMMIT
        return COMMIT

    def ends(self, out: bytes) -> bool:
        events, _ = split_events(out)
        return bool(events) and event_name(events[-1]) in self.LAST

    def error_event(self, message: str, last: bytes) -> bytes:
        number = (_json_data(last) or {}).get("sequence_number")
        body = {
            "type": "error",
            "code": "replica_failed",
            "message": message,
            "param": None,
            "sequence_number": number + 1 if isinstance(number, int) else 0,
        }
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


class MessagesFormat(StreamFormat):
    """Anthropic's Messages: named events from `message_start` to `message_stop` (or `error`)."""

    HELD = frozenset({b"message_start", b"ping"})
    LAST = frozenset({b"message_stop", b"error"})

    def classify(self, event: bytes) -> str:
        name = event_name(event)
        if name is None or name in self.HELD:
            return HOLD
        if name == b"error":
            error = (_json_data(event) or {}).get("error") or {}
            return _error_verdict(error.get("type"), not_ready="overloaded_error", server="api_error")
        return COMMIT

    def ends(self, out: bytes) -> bool:
        events, _ = split_events(out)
        return bool(events) and event_name(events[-1]) in self.LAST

    def error_event(self, message: str, last: bytes) -> bytes:
        return b"event: error\ndata: " + json.dumps(anthropic_error_body(500, message)).encode() + b"\n\n"


def _error_verdict(kind: Any, not_ready: str, server: str) -> str:
    return NOT_READY if kind == not_ready else SERVER_ERROR if kind == server else COMMIT


# How each relayed endpoint's streams are framed.
FORMATS: dict[str, StreamFormat] = {"responses": ResponsesFormat(), "messages": MessagesFormat()}
OPENAI_STREAM = StreamFormat()


def format_of(endpoint: str) -> StreamFormat:
    return FORMATS.get(endpoint, OPENAI_STREAM)


def _role_only(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None or choice.get("logprobs"):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False  # a completions chunk: its text is content, even when empty
    return all(not value for key, value in delta.items() if key != "role")


async def open_stream(resp: aiohttp.ClientResponse, fmt: StreamFormat = OPENAI_STREAM) -> Opened | NotOpened:
    """Read events up to the commit point. Transport errors propagate (a failed attempt)."""
    chunks = resp.content.iter_any()  # each chunk as it arrives, not a fixed size
    held: list[bytes] = []
    buf = b""
    async for chunk in chunks:
        buf += chunk
        events, buf = split_events(buf)
        for i, event in enumerate(events):
            verdict = fmt.classify(event)
            if verdict == HOLD:
                held.append(event)
                continue
            if verdict != COMMIT:
                return NotOpened(verdict, _error_message(event))
            first = b"".join([*held, *events[i:]])
            return Opened(first, buf, chunks, fmt.ends(first))
    return NotOpened("transport_error", "the replica ended the stream before sending anything")


def _error_message(event: bytes) -> str:
    obj = _json_data(event) or {}
    error = obj.get("error") or (obj.get("response") or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else "error event"


class Upstream:
    """The replica's response and whatever else ends with it (the replica's in-flight count,
    metrics), closed exactly once: by the relay when it ends, or by the response when the
    client left before the relay ever ran (a generator that never started runs no finally)."""

    def __init__(self, resp: aiohttp.ClientResponse, on_end: Callable[[str], None]) -> None:
        self.resp, self.on_end, self.closed = resp, on_end, False

    async def close(self, outcome: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.resp.release()  # kept when the body was read to its end, else closed (the replica aborts)
        finally:
            self.on_end(outcome)


async def relay(
    opened: Opened, upstream: Upstream, on_fault: Callable[[str], None], fmt: StreamFormat = OPENAI_STREAM
) -> AsyncIterator[bytes]:
    """The committed stream, whole events at a time; `on_fault(why)` if the replica fails."""
    outcome = CLIENT_GONE  # unless the stream gets to its end
    last = opened.first
    try:
        yield opened.first
        done, buf = opened.done, opened.rest
        if not done:
            async for chunk in opened.chunks:
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                out, buf = buf[: cut + 2], buf[cut + 2 :]
                yield out
                last = out
                if fmt.ends(out):
                    done = True
                    break
        if not done:
            raise Truncated("the replica closed the stream before it was complete")
        outcome = OK
        await _drain(opened.chunks)
    except (ClientError, Truncated) as exc:
        outcome = STREAM_ERROR
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        on_fault(why)
        events, _ = split_events(last)
        yield fmt.error_event(
            f"the replica serving this stream failed ({why}); the stream ends here",
            events[-1] if events else b"",
        )
    finally:
        await upstream.close(outcome)


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read the end of the body after its last event (the chunked terminator, normally): a response
    closed before its end closes its connection, and the next request would pay a new one."""
    with anyio.move_on_after(DRAIN_TIMEOUT_S):
        try:
            async for _ in chunks:
                pass
        except ClientError:
            pass


class RelayResponse(StreamingResponse):
    """A stream whose generator is always closed when the response ends, so the upstream
    response is closed (and the replica aborts its request) as soon as the client leaves,
    not when the generator is garbage-collected."""

    def __init__(
        self, content: AsyncIterator[bytes], upstream: Upstream, status_code: int, headers: dict[str, str]
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self.upstream = upstream

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.upstream.close(CLIENT_GONE)
