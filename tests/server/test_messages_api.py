"""The real server driven by the official `anthropic` client on /v1/messages: the reply's shape
and usage, streamed replies equal to whole ones, stop reasons, a tool round trip, count_tokens,
thinking blocks, and errors in Anthropic's envelope (auth, validation and routing included).

Replies are pinned with vLLM's `structured_outputs` regex where a test needs known text: the
test model's free text is not something to assert on."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow
KEY = "sk-test-alice-0123456789"
MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
THINK = {"structured_outputs": {"regex": "<think>[a-z ]{1,30}</think>[a-z ]{1,30}"}}


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"alice:{KEY}\n")
    return make_server(["--api-key-file", str(key_file), "--reasoning-parser", "qwen3"], api_key=KEY)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def greedy(kw: dict) -> dict:
    """The client (2.17) no longer takes sampling fields as arguments; the server still reads them."""
    kw.setdefault("max_tokens", 8)
    kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    return kw


def create(client, messages=HELLO, **kw):
    return client.messages.create(model=MODEL, messages=messages, **greedy(kw))


def streamed(client, messages=HELLO, **kw):
    """(the text_stream's text, the final message) of the same request, streamed."""
    with client.messages.stream(model=MODEL, messages=messages, **greedy(kw)) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def generation_tokens(server) -> tuple[float, float]:
    """fornax:generation_tokens_total and the messages route's fornax:requests_total."""
    metrics = httpx.get(server.url + "/metrics", headers=server.admin_headers, timeout=10).text
    found = re.search(r'^fornax:generation_tokens_total\{model_name="[^"]+"\} (\S+)$', metrics, re.M)
    requests = re.search(
        r'^fornax:requests_total\{endpoint="messages",model_name="[^"]+"\} (\S+)$', metrics, re.M
    )
    assert found and requests, metrics[:500]
    return float(found.group(1)), float(requests.group(1))


def test_message_shape_usage_and_accounting(server, client):
    tokens, requests = generation_tokens(server)
    r = create(client, system="You are terse.")
    assert re.fullmatch(r"msg_[0-9a-f]{32}", r.id) and r.type == "message" and r.role == "assistant"
    assert r.model == MODEL and r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
    assert 0 < u.output_tokens <= 8
    # Counted like chat: the metrics, and the request record (the access log line) as "messages".
    assert generation_tokens(server) == (tokens + u.output_tokens, requests + 1)
    assert re.search(rf"{r.id.replace('_', '-', 1)} key=alice messages prompt=", server.log())


def test_stream_equals_whole_reply(client):
    create(client, max_tokens=1)  # the same cached prefix for both (bf16 near-ties: test_openai_api.py)
    whole = create(client, max_tokens=12)
    text, final = streamed(client, max_tokens=12)
    assert text == text_of(whole) and blocks(final) == blocks(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_stop_sequence_and_max_tokens(client):
    pinned = {"structured_outputs": {"regex": "one two three four five"}}
    r = create(client, max_tokens=20, stop_sequences=[" three"], extra_body=pinned)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " three" and text_of(r) == "one two"
    long = {"structured_outputs": {"regex": "[a-z]{10,20}( [a-z]{10,20}){5}"}}
    r = create(client, max_tokens=3, extra_body=long)
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 3


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_round_trip(client):
    forced = {"type": "tool", "name": "get_weather"}
    r = create(client, ASK, max_tokens=40, tools=[WEATHER], tool_choice=forced)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert re.fullmatch(r"toolu_\w+", call.id) and call.name == "get_weather"
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    _, final = streamed(client, ASK, max_tokens=40, tools=[WEATHER], tool_choice=forced)
    (streamed_call,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed_call.input == call.input and final.stop_reason == "tool_use"

    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "Sunny, 21 C"}],
    }
    history = [*ASK, {"role": "assistant", "content": r.content}, {"role": "user", "content": [result]}]
    answer = create(client, history, max_tokens=12, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_count_tokens_is_the_prompt(client):
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system="You are terse.")
    r = create(client, system="You are terse.", max_tokens=1)
    assert count.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


def test_thinking_block_streamed_and_whole(client):
    whole = create(
        client, max_tokens=60, thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=THINK
    )
    assert [b.type for b in whole.content] == ["thinking", "text"], blocks(whole)
    assert whole.content[0].thinking.strip() and whole.content[0].signature.startswith("sha256:")
    text, final = streamed(
        client, max_tokens=60, thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=THINK
    )
    assert blocks(final) == blocks(whole) and text == text_of(whole)
    # Thinking sent back is dropped from the prompt: the conversation goes on.
    history = [*HELLO, {"role": "assistant", "content": whole.content}, {"role": "user", "content": "Again."}]
    assert create(client, history, max_tokens=2).content is not None


def _raw(server, body: dict, key: str = KEY, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": key}, timeout=60)


def _assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert (
        body["type"] == "error"
        and body["error"]["type"] == kind
        and set(body["error"]) == {"type", "message"}
    )
    return body["error"]["message"]


def test_bad_requests_are_anthropic_errors(server, client):
    missing = _raw(server, {"model": MODEL, "messages": HELLO})
    assert "max_tokens" in _assert_anthropic_error(missing, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as bad_role:
        create(client, [{"role": "system", "content": "hi"}])
    assert bad_role.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as bad_block:
        create(client, [{"role": "user", "content": [image]}])
    assert "'image'" in bad_block.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", messages=HELLO, max_tokens=4)
    assert unknown.value.body == {"type": "error", "error": unknown.value.body["error"]}
    assert unknown.value.body["error"]["type"] == "not_found_error"
    counted = _raw(
        server, {"messages": [{"role": "user", "content": [image]}]}, path="/v1/messages/count_tokens"
    )
    _assert_anthropic_error(counted, 400, "invalid_request_error")


def test_auth_by_x_api_key(server):
    denied = _raw(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2}, key="sk-wrong")
    _assert_anthropic_error(denied, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, messages=HELLO, max_tokens=2
        )
    # x-api-key serves every route, and other routes keep OpenAI's envelope.
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    assert _raw(server, chat, path="/v1/chat/completions").status_code == 200
    wrong = _raw(server, chat, key="sk-wrong", path="/v1/chat/completions")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    bearer = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
        headers=server.headers,
        timeout=60,
    )
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_sse_framing(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 60, "stream": True, "temperature": 0, **THINK}
    with httpx.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert events[-2]["type"] == "message_delta" and events[-2]["delta"]["stop_reason"] == "end_turn"
    # one block at a time: each start follows the previous block's stop, indexes 0, 1, ...
    bounds = [
        (e["type"], e["index"]) for e in events if e["type"] in ("content_block_start", "content_block_stop")
    ]
    assert bounds == [
        (kind, i) for i in range(len(bounds) // 2) for kind in ("content_block_start", "content_block_stop")
    ]
    assert len(bounds) == 4 and events[1]["content_block"]["type"] == "thinking"
    stop = events.index({"type": "content_block_stop", "index": 0})
    assert events[stop - 1]["delta"]["type"] == "signature_delta"
