"""Each relayed API's stream framing (fornax/router/stream.py): what is held before the commit
point, what counts as the replica's failure, what ends a stream, and the error event a broken
stream ends with, in that API's own shape."""

from __future__ import annotations

import json

from fornax.router.stream import (
    COMMIT,
    HOLD,
    NOT_READY,
    SERVER_ERROR,
    event_data,
    format_of,
    split_events,
)


def named(name: str, body: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **body})}\n\n".encode()


def test_chat_and_completions_keep_their_framing() -> None:
    fmt = format_of("chat")
    assert format_of("completions") is fmt
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    assert fmt.classify(role) == HOLD
    assert fmt.classify(b'data: {"error": {"type": "service_unavailable"}}\n\n') == NOT_READY
    assert fmt.ends(b"data: [DONE]\n\n") and not fmt.ends(role)
    assert fmt.error_event("gone", role).endswith(b"data: [DONE]\n\n")


def test_responses_stream() -> None:
    fmt = format_of("responses")
    assert fmt.classify(named("response.created", {"sequence_number": 0})) == HOLD
    assert fmt.classify(named("response.in_progress", {"sequence_number": 1})) == HOLD
    assert fmt.classify(named("response.output_item.added", {"sequence_number": 2})) == COMMIT
    engine_gone = named("response.failed", {"response": {"error": {"code": "server_error", "message": "x"}}})
    assert fmt.classify(engine_gone) == SERVER_ERROR  # tried on another replica
    bad_prompt = named("response.failed", {"response": {"error": {"code": "invalid_prompt", "message": "x"}}})
    assert fmt.classify(bad_prompt) == COMMIT  # the request's own fault: the client gets it
    for last in ("response.completed", "response.incomplete", "response.failed", "error"):
        assert fmt.ends(named("response.output_text.delta", {}) + named(last, {}))
    assert not fmt.ends(named("response.output_text.done", {}))
    error = fmt.error_event("gone", named("response.output_text.delta", {"sequence_number": 7}))
    ((event,), rest) = split_events(error)
    body = json.loads(event_data(event) or b"")
    assert rest == b"" and event.startswith(b"event: error\n")
    assert body == {
        "type": "error",
        "code": "replica_failed",
        "message": "gone",
        "param": None,
        "sequence_number": 8,
    }


def test_messages_stream() -> None:
    fmt = format_of("messages")
    assert fmt.classify(named("message_start", {"message": {}})) == HOLD
    assert fmt.classify(named("ping", {})) == HOLD
    assert fmt.classify(named("content_block_start", {"index": 0})) == COMMIT
    assert fmt.classify(named("error", {"error": {"type": "overloaded_error", "message": "x"}})) == NOT_READY
    assert fmt.classify(named("error", {"error": {"type": "api_error", "message": "x"}})) == SERVER_ERROR
    assert (
        fmt.classify(named("error", {"error": {"type": "invalid_request_error", "message": "x"}})) == COMMIT
    )
    assert fmt.ends(named("message_delta", {}) + named("message_stop", {}))
    assert not fmt.ends(named("content_block_stop", {"index": 0}))
    ((event,), _) = split_events(fmt.error_event("gone", b""))
    assert event.startswith(b"event: error\n")
    assert json.loads(event_data(event) or b"") == {
        "type": "error",
        "error": {"type": "api_error", "message": "gone"},
    }
