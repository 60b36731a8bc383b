"""Admission counts work, priorities are bounded and privileged, unimplemented fields are
refused, every tokenizer route is bounded, and a 4 MiB body never stalls the event loop."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
KEYS = {"alice": "sk-alice", "carol": "sk-carol", "ops": "sk-ops"}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(
        [
            "--api-key",
            f"alice:{KEYS['alice']}",
            "--api-key",
            f"carol:{KEYS['carol']}",
            "--admin-key",
            f"ops:{KEYS['ops']}",
            "--privileged-key",
            "carol",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-queued-sequences",
            "8",
            "--max-request-tokens",
            "2000",
            "--no-access-log",
        ],
        api_key=KEYS["ops"],
    )


def post(server, path: str, body: dict, key: str = "alice", timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def completion(**kw: object) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0, **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


UNIMPLEMENTED = [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", {"name": "f"}),
    ("best_of", 3),
    ("guided_whitespace_pattern", " *"),
    ("suffix", "and then"),
]


@pytest.mark.parametrize(("field", "value"), UNIMPLEMENTED)
def test_unimplemented_fields_are_refused_by_name(server, field: str, value: object) -> None:
    for path, body in (
        ("/v1/completions", completion()),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
    ):
        error = assert_error(post(server, path, {**body, field: value}), 400, param=field)
        assert field in error["message"]


def test_fields_that_ask_for_nothing_more_are_accepted(server) -> None:
    body = completion(
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        best_of=1,
        guided_decoding_backend="xgrammar",
    )
    assert post(server, "/v1/completions", body).status_code == 200


def test_tools_on_completions_are_refused_by_name(server) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    error = assert_error(post(server, "/v1/completions", completion(tools=tools)), 400, param="tools")
    assert "chat" in error["message"]


def test_priority_is_bounded_and_negative_ones_are_privileged(server) -> None:
    assert_error(post(server, "/v1/completions", completion(priority=1001)), 400, param="priority")
    assert_error(
        post(server, "/v1/completions", completion(priority=-1001), key="ops"), 400, param="priority"
    )
    assert_error(post(server, "/v1/completions", completion(priority=-1)), 403, param="priority")
    assert post(server, "/v1/completions", completion(priority=5)).status_code == 200
    for key in ("carol", "ops"):  # a privileged user key, and an admin key
        assert post(server, "/v1/completions", completion(priority=-5), key=key).status_code == 200


def test_admission_counts_sequences_and_tokens(server) -> None:
    # 4 prompts x n=4: 16 sequences, over the 8 that may wait.
    r = post(server, "/v1/completions", completion(prompt=["a", "b", "c", "d"], n=4))
    assert_error(r, 429, code="queue_full")
    assert r.headers["Retry-After"].isdigit()
    assert post(server, "/v1/completions", completion(prompt=["a", "b"], n=4)).status_code == 200
    # 2 prompts x n=4 x 300 tokens: over the per-request budget of 2,000 tokens.
    r = post(server, "/v1/completions", completion(prompt=["a", "b"], n=4, max_tokens=300))
    assert_error(r, 429, code="request_too_large")
    assert "2000" in r.json()["error"]["message"] and r.headers["Retry-After"].isdigit()


def test_tokenizer_routes_are_bounded_by_the_context(server) -> None:
    too_many_chars = "a" * (MAX_MODEL_LEN * 32 + 1)
    too_many_tokens = " ".join(["word"] * (MAX_MODEL_LEN + 10))  # ~520 tokens, few characters
    for path in ("/tokenize", "/v1/fornax/tokens"):
        assert_error(post(server, path, {"prompt": too_many_chars}), 400, code="context_length_exceeded")
        assert_error(post(server, path, {"prompt": too_many_tokens}), 400, code="context_length_exceeded")
        messages = [{"role": "user", "content": too_many_tokens}]
        assert_error(post(server, path, {"messages": messages}), 400, code="context_length_exceeded")
        assert post(server, path, {"prompt": "fine"}).status_code == 200
    ids = [100] * (MAX_MODEL_LEN + 1)
    assert_error(
        post(server, "/detokenize", {"tokens": ids}), 400, param="tokens", code="context_length_exceeded"
    )
    assert post(server, "/detokenize", {"tokens": ids[:10]}).status_code == 200


def test_a_4_mib_body_does_not_stall_the_event_loop(server, tmp_path) -> None:
    ids = [(i * 7919) % 49000 for i in range(600_000)]
    body = json.dumps(completion(prompt=ids)).encode()
    assert 3.5 * 2**20 < len(body) < 4 * 2**20

    headers = {"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"}
    # The big request goes from another process (curl), so the probe's timings are the server's
    # alone, not this process's own work of sending 4 MiB.
    path = tmp_path / "body.json"
    path.write_bytes(body)
    sender = subprocess.Popen(
        [
            "curl",
            "-s",
            "-o",
            str(tmp_path / "answer.json"),
            "-w",
            "%{http_code}",
            "-H",
            f"Authorization: {headers['Authorization']}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{path}",
            server.url + "/v1/completions",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=5) as probe:
        probe.get("/health")  # a warm connection
        while sender.poll() is None:
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    status = sender.communicate()[0]
    response = httpx.Response(int(status), content=(tmp_path / "answer.json").read_bytes())
    assert_error(response, 400, code="context_length_exceeded")  # parsed, checked, refused
    assert len(latencies) >= 5, latencies  # the probe ran while the body was being handled
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
