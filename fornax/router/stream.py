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
last event boundary per chunk, no parsing), never part of one. If the replica fails or
closes the stream before its `data: [DONE]`, the incomplete tail is dropped and the stream
ends with an OpenAI-shaped error event and `data: [DONE]`: the client never gets a chunk
the replica did not finish, and in particular no finish_reason it did not send.
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
from fornax.server.errors import error_body

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


def classify(event: bytes) -> str:
    """HOLD, COMMIT, NOT_READY or SERVER_ERROR for an event seen before the commit point."""
    data = event_data(event)
    if data is None:
        return HOLD
    if data == b"[DONE]":
        return COMMIT
    try:
        obj: Any = json.loads(data)
    except ValueError:
        return COMMIT  # not ours to judge: the client gets it as the replica sent it
    if not isinstance(obj, dict):
        return COMMIT
    error = obj.get("error")
    if isinstance(error, dict):
        kind = error.get("type")
        return (
            NOT_READY if kind == "service_unavailable" else SERVER_ERROR if kind == "server_error" else COMMIT
        )
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and obj.get("usage") is None and all(map(_role_only, choices)):
        return HOLD
    return COMMIT


def _role_only(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None or choice.get("logprobs"):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False  # a completions chunk: its text is content, even when empty
    return all(not value for key, value in delta.items() if key != "role")


async def open_stream(resp: aiohttp.ClientResponse) -> Opened | NotOpened:
    """Read events up to the commit point. Transport errors propagate (a failed attempt)."""
    chunks = resp.content.iter_any()  # each chunk as it arrives, not a fixed size
    held: list[bytes] = []
    buf = b""
    async for chunk in chunks:
        buf += chunk
        events, buf = split_events(buf)
        for i, event in enumerate(events):
            verdict = classify(event)
            if verdict == HOLD:
                held.append(event)
                continue
            if verdict != COMMIT:
                return NotOpened(verdict, _error_message(event))
            first = b"".join([*held, *events[i:]])
            return Opened(first, buf, chunks, first.endswith(DONE_EVENT))
    return NotOpened("transport_error", "the replica ended the stream before sending anything")


def _error_message(event: bytes) -> str:
    try:
        return str(json.loads(event_data(event) or b"{}")["error"].get("message", "error event"))
    except (ValueError, KeyError, AttributeError):
        return "error event"


def error_event(message: str) -> bytes:
    body = error_body(message, "server_error", code="replica_failed")
    return b"data: " + json.dumps(body).encode() + b"\n\n" + DONE_EVENT


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


async def relay(opened: Opened, upstream: Upstream, on_fault: Callable[[str], None]) -> AsyncIterator[bytes]:
    """The committed stream, whole events at a time; `on_fault(why)` if the replica fails."""
    outcome = CLIENT_GONE  # unless the stream gets to its end
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
                if out.endswith(DONE_EVENT):
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
        yield error_event(f"the replica serving this stream failed ({why}); the stream ends here")
    finally:
        await upstream.close(outcome)


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read the end of the body after [DONE] (the chunked terminator, normally): a response
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

    def __init__(self, content: AsyncIterator[bytes], upstream: Upstream, status_code: int,
                 headers: dict[str, str]) -> None:  # fmt: skip
        super().__init__(content, status_code=status_code, headers=headers)
        self.upstream = upstream

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.upstream.close(CLIENT_GONE)
