"""Chat fields that were once dropped, on the default model with the official `openai` client:
the reasoning split (forced through a regex), continuing the final assistant message (and
echoing it), add_generation_prompt, prompt_logprobs on chat and completions, and usage on every
chunk with continuous_usage_stats."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
THINK = {"structured_outputs": {"regex": "<think>[a-z ]{1,30}</think>[a-z ]{1,30}"}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(["--reasoning-parser", "qwen3", "--no-access-log"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream_parts(chunks) -> tuple[str, str]:
    parts = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in parts)
    return reasoning, "".join(d.content or "" for d in parts)


def test_reasoning_content_split_streamed_and_not(client) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 64, "temperature": 0, "extra_body": THINK}
    message = client.chat.completions.create(**body).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "<think>" not in message.content + reasoning
    assert "</think>" not in message.content + reasoning
    assert _stream_parts(client.chat.completions.create(**body, stream=True)) == (reasoning, message.content)
    hidden = client.chat.completions.create(**{**body, "extra_body": {**THINK, "include_reasoning": False}})
    assert hidden.choices[0].message.content == message.content
    assert "reasoning_content" not in hidden.choices[0].message.model_extra


def test_continue_final_message_and_echo(server, client) -> None:
    start = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": start}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    cont = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    # The same as completing the rendered conversation cut right after the assistant's text,
    # where the template goes on to close the turn with "<|im_end|>" and "\n".
    ids = httpx.post(
        server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()["tokens"]
    ref = client.completions.create(model=MODEL, prompt=ids[:-2], max_tokens=6, temperature=0)
    assert cont.choices[0].message.content == ref.choices[0].text
    assert cont.usage.prompt_tokens == ref.usage.prompt_tokens
    echoed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={**extra, "echo": True}
    )
    assert echoed.choices[0].message.content == start + ref.choices[0].text
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={**extra, "echo": True},
        stream=True,
    )
    assert _stream_parts(streamed)[1] == start + ref.choices[0].text


def test_generation_prompt_switch_and_bad_continuations(client) -> None:
    with_prompt = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    without = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert without.usage.prompt_tokens < with_prompt.usage.prompt_tokens  # no "<|im_start|>assistant\n"
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(
            model=MODEL,
            messages=[*QUESTION, {"role": "assistant", "content": "Pa"}],
            max_tokens=1,
            extra_body={"continue_final_message": True},
        )
    with pytest.raises(openai.BadRequestError, match="assistant"):
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body=extra)


def _check_prompt_logprobs(entries, prompt_ids: list[int], k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for entry, tid in zip(entries[1:], prompt_ids[1:], strict=True):
        assert str(tid) in entry and len(entry) <= k + 1
        assert all(v["logprob"] <= 0 and v["decoded_token"] is not None for v in entry.values())


def test_prompt_logprobs_on_completions_and_chat(server, client) -> None:
    prompt = "Roses are red, violets are"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    _check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], ids, 2)
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            extra_body={"prompt_logprobs": 2},
        )
    )
    first = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed if c.choices]
    assert first[0] == r.choices[0].model_extra["prompt_logprobs"] and not any(first[1:])
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()["tokens"]
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    _check_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_ids, 0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
        )
    )
    shown = [c.model_extra.get("prompt_logprobs") for c in chunks if c.model_extra.get("prompt_logprobs")]
    assert len(shown) == 1 and len(shown[0]) == len(chat_ids)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 10**6}
        )


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats(client, route) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options=options,
            )
        )
    else:
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options=options,
            )
        )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
