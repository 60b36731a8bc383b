"""Every error path answers the OpenAI envelope with the right status; fuzzed input never
gets a 5xx; auth; and a client that disconnects frees its KV blocks."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
KEY = "sk-errors-test"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(
        [
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-body-bytes",
            str(MAX_BODY),
            "--max-n",
            "4",
            "--max-stop-strings",
            "4",
            "--max-logit-bias",
            "8",
            "--max-top-logprobs",
            "5",
            "--max-messages",
            "16",
        ],
        env={"FORNAX_API_KEY": KEY},
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def assert_error(
    r: httpx.Response,
    status: int,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if type_ is not None:
        assert err["type"] == type_, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- auth ------------------------------------------------------------------------------------------


def test_auth(server):
    assert httpx.get(server.url + "/health").status_code == 200  # public
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic x"},
    ):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/admin/usage"),
            ("GET", "/version"),
            ("POST", "/tokenize"),
            ("GET", "/nope"),
        ):
            r = httpx.request(method, server.url + path, headers=headers, json=chat_body())
            assert_error(r, 401, "authentication_error")
    assert httpx.get(server.url + "/v1/models", headers=server.headers).status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json=chat_body())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- error envelopes -------------------------------------------------------------------------------


def test_context_length_exceeded(http):
    long_text = "word " * 400
    err = assert_error(
        http.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": long_text}])),
        400,
        "invalid_request_error",
        code="context_length_exceeded",
    )
    assert str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 300}),
        400,
        code="context_length_exceeded",
        param="max_tokens",
    )
    assert "300" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    # max_tokens absent: clamped to what the context leaves, never an error
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello " * 200, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == MAX_MODEL_LEN
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(temperature=-1), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(top_k=-5), "top_k"),
        (chat_body(n=5), "n"),
        (chat_body(n=0), "n"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(max_tokens=-3), "max_tokens"),
        (chat_body(presence_penalty=5), "presence_penalty"),
        (chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat_body(stop=[""]), "stop"),
        (chat_body(logit_bias={str(i): 1 for i in range(9)}), "logit_bias"),
        (chat_body(logit_bias={"abc": 1}), "logit_bias"),
        (chat_body(logit_bias={"99999999": 1}), "logit_bias"),
        (chat_body(logprobs=True, top_logprobs=6), "top_logprobs"),
        (chat_body(top_logprobs=2), "top_logprobs"),
        (chat_body(seed=2**70), "seed"),
        (chat_body(priority=2**40), "priority"),
        (chat_body(min_tokens=5), "min_tokens"),
        (chat_body(messages=[]), "messages"),
        (chat_body(messages=[{"role": "user", "content": "x"}] * 17), "messages"),
        (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
        (chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content"),
        (chat_body(stop_token_ids=[10**9]), "stop_token_ids"),
        (chat_body(stream_options={"include_usage": True}), "stream_options"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(n="two"), "n"),
        (chat_body(messages="hello"), "messages"),
        (chat_body(stream="yes please"), "stream"),
        ({"model": MODEL}, "messages"),
    ],
)
def test_invalid_values_are_400_with_param(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error", param=param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [[]]}, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
        ({"model": MODEL, "prompt": [1, -2]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": MODEL, "prompt": {"a": 1}}, "prompt"),
        ({"model": MODEL}, "prompt"),
    ],
)
def test_invalid_completions_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_request_error", param=param)


def test_unknown_model_route_method(http):
    assert_error(
        http.post("/v1/chat/completions", json=chat_body(model="gpt-9")),
        404,
        code="model_not_found",
        param="model",
    )
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)
    assert_error(http.post("/detokenize", json={"tokens": [10**8]}), 400, param="tokens")


def test_unknown_fields_ignored(http):
    r = http.post("/v1/chat/completions", json=chat_body(frobnicate=True, tools_choice_x={"a": 1}))
    assert r.status_code == 200, r.text


def test_oversized_bodies_are_413(server, http):
    big = chat_body(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])
    assert_error(http.post("/v1/chat/completions", json=big), 413)

    def chunked():  # no Content-Length: the server must count while reading
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}]}'

    assert_error(http.post("/v1/chat/completions", content=chunked()), 413)
    # A lying Content-Length on a raw socket: the server stops at its limit, not at the header.
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {MAX_BODY * 100}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        reply = s.recv(4096).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]


# ---- fuzz ------------------------------------------------------------------------------------------


FUZZ_BODIES: list[bytes] = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"42",
    b'"x"',
    b'{"messages": [}',
    b"\xff\xfe\x00garbage",
    b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b'{"prompt": "\xed\xa0\x80"}',
    b"[" * 50000 + b"]" * 50000,
    b'{"a":' * 20000 + b"1" + b"}" * 20000,
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
]
FUZZ_JSON: list[dict] = [
    chat_body(max_tokens=10**30),
    chat_body(max_tokens=2**63),
    chat_body(n=10**20),
    chat_body(n=-1),
    chat_body(top_k=10**40),
    chat_body(seed=-(2**80)),
    chat_body(temperature=1e308),
    chat_body(priority=10**30),
    chat_body(logit_bias={"1": 1e308}),
    chat_body(logit_bias=[1, 2]),
    chat_body(stop=12),
    chat_body(stop=[1]),
    chat_body(messages=[{"role": "user", "content": None}]),
    chat_body(messages=[{}]),
    chat_body(messages=[None]),
    chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat_body(logprobs="yes"),
    chat_body(top_logprobs=-1, logprobs=True),
    chat_body(min_p=2),
    chat_body(repetition_penalty=0),
    chat_body(stream_options="x", stream=True),
    chat_body(model=123),
    chat_body(user=["x"]),
    chat_body(max_completion_tokens=-1),
    chat_body(min_tokens=-1),
    chat_body(stop_token_ids=[-1]),
    {"model": MODEL, "prompt": [[1, 2], "mixed"]},
    {"model": MODEL, "prompt": [1.5]},
    {"model": MODEL, "prompt": "x", "echo": "no", "max_tokens": 2},
    {"model": MODEL, "prompt": "x", "logprobs": True, "max_tokens": 2},
    {"model": MODEL, "prompt": ["x"] * 1000},
]


def test_fuzz_only_4xx_and_server_stays_healthy(server, http):
    statuses = []
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        for body in FUZZ_BODIES:
            t0 = time.monotonic()
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            statuses.append((time.monotonic() - t0, path, body[:40], r.status_code))
            assert 400 <= r.status_code < 500, (path, body[:60], r.status_code, r.text[:300])
            assert "Traceback" not in r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        for obj in FUZZ_JSON:
            t0 = time.monotonic()
            r = http.post(path, content=json.dumps(obj))
            statuses.append((time.monotonic() - t0, path, str(obj)[:80], r.status_code))
            assert r.status_code < 500, (path, obj, r.status_code, r.text[:300])
            assert "Traceback" not in r.text
    assert httpx.get(server.url + "/health").status_code == 200
    r = http.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    server.assert_idle()


# ---- disconnects -----------------------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_kv(server, http):
    before = server.state()["aborted_requests"]
    body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
        running = server.state()
        assert running["num_running"] == 1 and running["kv_cache_usage"] > 0
    # leaving the `with` closes the connection mid-stream
    state = server.wait_idle(timeout=10)
    assert state["num_running"] == 0 and state["kv_cache_usage"] == 0, state
    assert state["aborted_requests"] == before + 1
    assert state["kv_integrity"] == "ok"


def test_disconnect_while_waiting_non_streaming(server):
    before = server.state()["aborted_requests"]
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=server.headers,
            timeout=1.0,
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True},
        )
    state = server.wait_idle(timeout=10)
    assert state["num_running"] == 0 and state["kv_cache_usage"] == 0, state
    assert state["aborted_requests"] == before + 1
    assert time.monotonic() - start < 8  # aborted, not run to its 240 tokens
