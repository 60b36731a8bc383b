"""`LLM.chat(messages, tools=...)` on the default model: the same tool-call structure as the
server's message (ids, names, JSON arguments that validate, finish_reason "tool_calls"), and a
follow-up turn with the tool's result rendered through the template fallback."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fornax import LLM, SamplingParams

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(str(default_gguf), progress=False, kv_cache_memory="256MiB")


def test_forced_and_named_calls_offline(llm):
    messages = [{"role": "user", "content": "What is the weather in Madrid?"}]
    params = SamplingParams(temperature=0.0, max_tokens=120)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        (out,) = llm.chat(messages, params, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)
        (completion,) = out.outputs
        assert completion.finish_reason == "tool_calls", completion.text
        (call,) = completion.tool_calls
        assert call.id.startswith("call_") and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
        assert completion.content is None


def test_follow_up_turn_with_the_tool_result(llm):
    messages = [
        {"role": "user", "content": "What is the weather in Madrid?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Madrid"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 30, "sky": "sunny"}'},
    ]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40), tools=[WEATHER])
    completion = out.outputs[0]
    assert completion.text and completion.tool_calls is None and completion.content == completion.text
    # The tool's answer reached the prompt (the template has no tool support: the fallback wrote it).
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>" in prompt and '"temp_c": 30' in prompt and "get_weather" in prompt
