"""Anthropic's Messages API without a server: the request's translation into a chat request,
the content blocks built from split output, the error envelope chosen by path, x-api-key."""

from __future__ import annotations

import asyncio
import json

import pytest

from fornax.server.anthropic_messages import _Accumulated, _Blocks, to_chat_request
from fornax.server.anthropic_protocol import MessagesCountTokensRequest, MessagesRequest
from fornax.server.auth import KeyStore
from fornax.server.errors import ApiError
from fornax.tools import ToolCallDelta
from fornax.tools.output import Piece

TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def request(**body) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 8, **body})


def test_conversation_with_tools_translates_to_chat() -> None:
    req = request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": True},
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        stop_sequences=["END"],
        top_k=5,
    )
    chat = to_chat_request(req)
    turns = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert turns[0] == {"role": "system", "content": "Be brief.\nBe kind."}
    assert turns[2]["content"] == "Checking." and "hmm" not in json.dumps(turns)
    (call,) = turns[2]["tool_calls"]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert turns[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"}
    assert turns[4] == {"role": "user", "content": "And now?"}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert chat.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 8
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_named_tool_prefill_and_output_format() -> None:
    chat = to_chat_request(
        request(
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}],
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        )
    )
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.structured_outputs == {"json": {"type": "object"}}
    counted = to_chat_request(
        MessagesCountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    )
    assert counted.max_tokens is None and counted.messages[0].content == "x"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "s"}],
            },
            "tools.0.type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system.0.type"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "assistant", "content": " "}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "u"}]}, "mcp_servers"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema", "schema": {}}},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs",
        ),
    ],
)
def test_unsupported_input_is_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        to_chat_request(request(**body))
    assert err.value.status == 400 and err.value.param == param


def run_blocks(pieces: list[Piece]) -> tuple[list[dict], dict]:
    """The events for `pieces`, and the message they accumulate into."""
    blocks = _Blocks()
    events = [{"type": "message_start", "message": {"content": []}}]
    for piece in pieces:
        events += blocks.feed(piece)
    events += blocks.close()

    async def gen():
        for event in events:
            yield event

    message = _Accumulated()
    asyncio.run(message.read(gen()))
    return events, message.message


def test_blocks_keep_the_order_and_skip_blank_text() -> None:
    call = [ToolCallDelta(0, id="call_abc", name="f", arguments='{"a": '), ToolCallDelta(0, arguments="1}")]
    pieces = [
        Piece(reasoning="\n"),
        Piece(reasoning="think"),
        Piece(content="\n"),
        Piece(content="Hi"),
        Piece(calls=call),
        Piece(content="\n\n"),
        Piece(content="bye"),
    ]
    events, message = run_blocks(pieces)
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]
    thinking, text, tool, tail = message["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "\nthink"
    assert thinking["signature"].startswith("sha256:")
    assert text == {"type": "text", "text": "\nHi"}
    assert tool == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}}
    assert tail == {"type": "text", "text": "\n\nbye"}
    # whitespace alone makes no block
    assert run_blocks([Piece(calls=call), Piece(content="\n")])[1]["content"][0]["type"] == "tool_use"
    assert len(run_blocks([Piece(calls=call), Piece(content="\n")])[1]["content"]) == 1


def test_error_envelope_is_chosen_by_path() -> None:
    err = ApiError(413, "too big")
    assert err.envelope("/v1/messages") == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "too big"},
    }
    assert ApiError(503, "x").envelope("/v1/messages/count_tokens")["error"]["type"] == "overloaded_error"
    assert ApiError(418, "x").envelope("/v1/messages")["error"]["type"] == "invalid_request_error"
    assert err.envelope("/v1/messagesx")["error"]["type"] == "invalid_request_error"  # OpenAI's envelope
    assert set(err.envelope("/v1/chat/completions")["error"]) == {"message", "type", "param", "code"}


def test_x_api_key_identifies_like_bearer() -> None:
    keys = KeyStore((("alice", "ka"),))
    assert keys.identify(None, "ka") == keys.identify("Bearer ka") == ("alice", "user")
    assert keys.identify(None, "kx") is None and keys.identify(None, "") is None
    assert keys.identify("Bearer kx", "ka") is None  # a Bearer token, when sent, is the one checked


def test_one_piece_holding_a_call_end_text_and_a_new_call_keeps_text_order() -> None:
    first = ToolCallDelta(0, id="call_a", name="f", arguments='{"a": ')
    rest = [ToolCallDelta(0, arguments="1}"), ToolCallDelta(1, id="call_b", name="g", arguments="{}")]
    _, message = run_blocks([Piece(calls=[first]), Piece(content=" between ", calls=rest)])
    assert [(b["type"], b.get("input", b.get("text"))) for b in message["content"]] == [
        ("tool_use", {"a": 1}),
        ("text", " between "),
        ("tool_use", {}),
    ]
