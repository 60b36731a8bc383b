"""Reasoning on chat completions, through real servers and the official `openai` client.

A tiny random Qwen3 model whose test template opens `<think>` in the generation prompt and
closes it empty when `enable_thinking` is false (as Qwen3's own templates switch thinking):
the parser is picked from the template, the switch reaches the template (by
chat_template_kwargs or reasoning_effort), and a JSON schema holds for the answer after
`</think>`, not for the thinking. Logit bias decides what the random model writes.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.model.tiny_models import make_tokenizer_files

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "The quick brown fox?"}]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"enum": [1, 2]}},
    "required": ["n"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def tiny(make_server, tmp_path_factory):
    from tests.model.tiny_models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    build_tiny_model("qwen3", out)
    make_tokenizer_files(out, added_tokens=("<think>", "</think>"), chat_template=TEMPLATE)
    server = make_server(
        ["--model", str(out), "--served-model-name", "tiny", "--dtype", "float32", "--no-access-log"]
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    from fornax.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained_dir(out)
    word = tok.encode(" quick", False)[0]
    return client, {
        "</think>": tok.encode("</think>", False)[0],
        "word": word,
        "word_text": tok.decode([word]),
    }


def _chat(client, stream: bool = False, **kw):
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, **kw}
    if not stream:
        return client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reasoning or None, content


def test_thinking_on_the_schema_holds_after_the_thinking(tiny) -> None:
    client, ids = tiny
    bias = {str(ids["</think>"]): 100}  # the thinking ends at once; the grammar then decides
    r = _chat(client, max_tokens=40, logit_bias=bias, response_format=JSON_FORMAT)
    message = r.choices[0].message
    assert json.loads(message.content)["n"] in (1, 2)
    assert message.model_extra.get("reasoning_content") is None  # an empty thought
    assert r.choices[0].finish_reason == "stop"
    assert _chat(client, stream=True, max_tokens=40, logit_bias=bias, response_format=JSON_FORMAT) == (
        None,
        message.content,
    )


def test_thinking_text_goes_to_reasoning_content(tiny) -> None:
    client, ids = tiny
    bias = {str(ids["word"]): 100}  # it never stops thinking
    thought = (ids["word_text"] * 5).strip()  # the whitespace right after <think> is dropped
    r = _chat(client, max_tokens=5, logit_bias=bias, response_format=JSON_FORMAT)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == thought and not message.content
    assert r.choices[0].finish_reason == "length"
    assert _chat(client, stream=True, max_tokens=5, logit_bias=bias, response_format=JSON_FORMAT) == (
        thought,
        "",
    )
    hidden = _chat(client, max_tokens=5, logit_bias=bias, extra_body={"include_reasoning": False})
    assert (
        "reasoning_content" not in hidden.choices[0].message.model_extra
        and not hidden.choices[0].message.content
    )


@pytest.mark.parametrize(
    "switch",
    [{"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, {"reasoning_effort": "none"}],
)
def test_thinking_off_the_schema_holds_from_the_first_token(tiny, switch) -> None:
    client, ids = tiny
    on = _chat(client, max_tokens=40, logit_bias={str(ids["</think>"]): 100}, response_format=JSON_FORMAT)
    off = _chat(
        client, max_tokens=40, logit_bias={str(ids["</think>"]): 100}, response_format=JSON_FORMAT, **switch
    )
    assert (
        off.usage.prompt_tokens == on.usage.prompt_tokens + 1
    )  # the template closed the span: one more token
    assert json.loads(off.choices[0].message.content)["n"] in (1, 2)  # </think> was masked: JSON at once
    assert off.usage.completion_tokens == on.usage.completion_tokens - 1
