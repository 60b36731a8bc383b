"""Request bodies parse the same in a thread and in the worker process (body_parser.py): the
same models, down to nested models and the types of lists, and the same error envelopes; a
worker that dies or hangs costs its request a 503, and the next body gets a fresh worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from pydantic import BaseModel, model_validator

from fornax.server import body_parser
from fornax.server.errors import ApiError
from fornax.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)

INLINE = 1 << 40  # every body parses in a thread
WORKER = 0  # every body goes to the worker process


@pytest.fixture(scope="module", autouse=True)
def _stop_the_worker():
    yield
    body_parser.shutdown()


def parse(raw: bytes, model_cls: type[BaseModel], inline_max_bytes: int, timeout_s: float = 30) -> Any:
    """The parsed model, or the ApiError's (status, envelope, headers)."""

    async def run() -> BaseModel:
        return await body_parser.parse_bytes(
            raw, model_cls, inline_max_bytes=inline_max_bytes, timeout_s=timeout_s
        )

    try:
        return asyncio.run(run())
    except ApiError as exc:
        return exc.status, exc.envelope(), exc.headers


def both(raw: bytes, model_cls: type[BaseModel]) -> Any:
    inline, worker = parse(raw, model_cls, INLINE), parse(raw, model_cls, WORKER)
    if isinstance(inline, BaseModel):
        assert type(worker) is type(inline)
        assert worker.model_fields_set == inline.model_fields_set
        assert repr(worker) == repr(inline)  # types too: a list is a list, not an array or a tuple
    assert worker == inline
    return worker


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


CHAT = body(
    messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
    ],
    stream=True,
    stream_options={"include_usage": True},
    stop=["\n", "END"],
    logit_bias={"5": 1.5},
    unknown_field={"ignored": [1, 2]},
    max_completion_tokens=7,
)

VALID = {
    "chat": (CHAT, ChatCompletionRequest),
    "token ids": (body(prompt=list(range(70_000)), stop_token_ids=[1, 2], max_tokens=3), CompletionRequest),
    "nested token ids": (body(prompt=[[1, 2], [], [3], list(range(70_000))]), CompletionRequest),
    "many token-id lists": (body(prompt=[[i, i + 1] for i in range(20_000)]), CompletionRequest),
    "ids past 64 bits": (body(prompt=[2**70, 1]), CompletionRequest),
    "coerced ids": (body(prompt=[True, 2.0, 3]), CompletionRequest),
    "many strings": (body(prompt=[f"s{i}" for i in range(30_000)]), CompletionRequest),
    "big logit_bias": (body(prompt="x", logit_bias={str(i): 0.5 for i in range(10_000)}), CompletionRequest),
    "many messages": (
        body(messages=[{"role": "user", "content": f"m{i}"} for i in range(5_000)]),
        ChatCompletionRequest,
    ),
    "detokenize": (body(tokens=list(range(1000))), DetokenizeRequest),
    "tokenize": (
        body(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False),
        TokenizeRequest,
    ),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_bodies_parse_the_same_in_the_worker(name: str) -> None:
    raw, model_cls = VALID[name]
    parsed = both(raw, model_cls)
    assert isinstance(parsed, model_cls)


def test_nested_models_and_lists_are_real_after_the_worker() -> None:
    chat = parse(CHAT, ChatCompletionRequest, WORKER)
    assert all(type(m) is ChatMessage for m in chat.messages)
    assert type(chat.messages[1].content[0]) is ContentPart and type(chat.stream_options) is StreamOptions
    completion = parse(VALID["nested token ids"][0], CompletionRequest, WORKER)
    assert type(completion.prompt) is list and all(type(p) is list for p in completion.prompt)
    assert completion.prompt[3] == list(range(70_000)) and all(type(t) is int for t in completion.prompt[3])


INVALID = {
    "NaN": (b'{"prompt": [1], "temperature": NaN}', CompletionRequest),
    "1e400": (b'{"prompt": [1], "temperature": 1e400}', CompletionRequest),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe"}', CompletionRequest),
    "not an object": (b"[1, 2]", CompletionRequest),
    "not JSON": (b'{"prompt": [1,', CompletionRequest),
    "too deep": (b"[" * 100_000 + b"]" * 100_000, CompletionRequest),
    "type error": (body(prompt=[1, "a"]), CompletionRequest),
    "nested type error": (
        body(messages=[{"role": "user", "content": [{"text": "no type"}]}]),
        ChatCompletionRequest,
    ),
    "unimplemented field": (body(prompt="x", functions=[{"name": "f"}]), CompletionRequest),
    "missing field": (body(prompt="x"), DetokenizeRequest),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_bodies_get_the_same_error_from_the_worker(name: str) -> None:
    raw, model_cls = INVALID[name]
    status, envelope, _ = both(raw, model_cls)
    assert status == 400 and set(envelope["error"]) == {"message", "type", "param", "code"}


def test_refused_numbers_are_named() -> None:
    _, envelope, _ = parse(INVALID["NaN"][0], CompletionRequest, WORKER)
    assert (
        envelope["error"]["message"] == "the request body is not valid JSON: NaN is not a valid JSON number"
    )


# ---- a worker that dies or hangs ----------------------------------------------------------------------


class WhoParsed(BaseModel):
    """Parses to the id of the process that parsed it; `die` or `hang` in the body do that there."""

    pid: int = 0

    @model_validator(mode="before")
    @classmethod
    def _act(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("die"):
            os._exit(3)
        if data.get("hang"):
            time.sleep(60)
        return {"pid": os.getpid()}


def worker_pid() -> int:
    pid = parse(b"{}", WhoParsed, WORKER).pid
    assert pid != os.getpid()
    return pid


def gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def assert_unavailable(outcome: Any) -> None:
    status, envelope, headers = outcome
    assert status == 503 and envelope["error"]["code"] == "service_unavailable", envelope
    assert headers == {"Retry-After": "1"}


def test_a_worker_dying_mid_parse_costs_one_503_then_a_fresh_worker() -> None:
    first = worker_pid()
    assert_unavailable(parse(body(die=True), WhoParsed, WORKER))
    assert gone(first)
    second = worker_pid()
    assert second != first
    assert parse(VALID["chat"][0], ChatCompletionRequest, WORKER) == parse(
        VALID["chat"][0], ChatCompletionRequest, INLINE
    )


def test_a_worker_killed_while_idle_is_replaced_without_an_error() -> None:
    first = worker_pid()
    os.kill(first, signal.SIGKILL)
    assert gone(first)
    assert worker_pid() != first


def test_a_hung_worker_times_out_and_is_killed() -> None:
    first = worker_pid()
    start = time.monotonic()
    assert_unavailable(parse(body(hang=True), WhoParsed, WORKER, timeout_s=1))
    assert time.monotonic() - start < 10
    assert gone(first)
    assert worker_pid() != first


def test_shutdown_kills_the_worker() -> None:
    pid = worker_pid()
    body_parser.shutdown()
    assert gone(pid)


def test_the_worker_imports_neither_torch_nor_fastapi() -> None:
    # What a spawned worker imports: this module and its imports (the main module aside).
    code = "import sys, fornax.server.body_parser; print(sorted({'torch', 'fastapi', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_big_fields_travel_packed() -> None:
    def fields(name: str) -> dict[str, Any]:
        raw, model_cls = VALID[name]
        return body_parser.parse_packed(raw, model_cls).fields

    assert isinstance(fields("token ids")["prompt"], body_parser.IdList)
    assert isinstance(fields("nested token ids")["prompt"], body_parser.IdLists)
    assert isinstance(fields("ids past 64 bits")["prompt"], body_parser.Chunks)
    for name, field in (
        ("many strings", "prompt"),
        ("big logit_bias", "logit_bias"),
        ("many messages", "messages"),
    ):
        assert len(fields(name)[field].pieces) > 1, name
