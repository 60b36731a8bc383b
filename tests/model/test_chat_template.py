"""Chat templates: same output as transformers, and bounded, sandboxed rendering."""

from __future__ import annotations

import copy
import time
from datetime import datetime
from typing import Any

import pytest

import fornax.chat_template as chat_template_module
from fornax.chat_template import ChatTemplateError, render_chat_template
from fornax.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": '什么是 LLM 推理？ Answer in <b>one</b> line & be "exact".'}
ASSISTANT = {"role": "assistant", "content": "Running a trained model 😀."}
CONVERSATIONS = {
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "More?"}],
    "no_system": [USER],  # SmolLM's template inserts its default system prompt
    "no_system_multi_turn": [USER, ASSISTANT, {"role": "user", "content": "\tand\n\nthen"}],
}
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "a <b> & 'c'", "parameters": {}}}]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_render_matches_transformers(
    ours: Tokenizer, reference: Any, name: str, add_generation_prompt: bool
) -> None:
    messages, flag = CONVERSATIONS[name], add_generation_prompt
    expected = reference.apply_chat_template(messages, add_generation_prompt=flag, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=flag) == expected
    expected_ids = reference.apply_chat_template(
        messages, add_generation_prompt=flag, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=flag, tokenize=True) == list(expected_ids)


def test_content_parts_are_flattened(ours: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template([{"role": "user", "content": "a\nb"}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


CUSTOM_TEMPLATES = [
    # tojson as transformers defines it: no HTML escaping, non-ASCII kept, indent/sort_keys work
    "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ messages[0] | tojson(sort_keys=true) }}",
    # loop helpers still work through the loop guard, as do loop controls and namespaces
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.last %}{{ loop.length }}:{{ loop.index }}"
    "{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ m.content[:3] }}{% else %}empty{% endfor %}={{ ns.n }}",
    "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
    "{{ eos_token }}",
    "{% for k, v in (messages[0] | dictsort) %}{{ loop.revindex }}{{ k }}={{ v[:4] }}"
    "{{ loop.cycle(',', ';') }}{% endfor %}"
    "{% for m in [{'c': [{'c': []}, {'c': []}]}] recursive %}[{{ loop(m.c) }}]{% endfor %}",
    "{{ 5000000 | string }} {{ 1700000000 | tojson }} {{ (10 ** 7) | int }} {{ 'ab' | truncate(3) }}",
    "{% if custom_flag %}{{ custom_flag }}{% endif %}{{ messages | length }}{{ tools is none }}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_custom_templates_match_transformers(ours: Tokenizer, reference: Any, template: str) -> None:
    messages = CONVERSATIONS["multi_turn"]
    kwargs: dict[str, Any] = {"custom_flag": "yes"}
    if "tools" in template and "tools is none" not in template:
        kwargs["tools"] = TOOLS
    expected = reference.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, chat_template=template, **kwargs) == expected


def test_strftime_now(ours: Tokenizer) -> None:
    rendered = ours.apply_chat_template([USER], chat_template="{{ strftime_now('%Y') }}")
    assert rendered == str(datetime.now().year)


def test_no_chat_template_is_a_clear_error(ours: Tokenizer) -> None:
    bare = copy.copy(ours)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template; use completions"):
        bare.apply_chat_template([USER])


def test_raise_exception_surfaces(ours: Tokenizer) -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="need a system message"):
        ours.apply_chat_template([USER], chat_template=template)


def test_syntax_error_is_a_chat_template_error(ours: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ours.apply_chat_template([USER], chat_template="{% for m in messages %}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set _ = messages.append(1) %}",  # the immutable sandbox refuses to mutate lists
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_blocks_escapes(template: str) -> None:
    # An unsafe attribute is either refused outright or reads as undefined, which renders as "".
    try:
        rendered = render_chat_template(template, {"messages": [USER]})
    except ChatTemplateError as exc:
        assert "unsafe" in str(exc) or "not safely callable" in str(exc) or "immutable" in str(exc), exc
    else:
        assert rendered == ""


HOSTILE = [
    "{% for i in range(10**9) %}x{% endfor %}",  # the sandbox caps range()
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 1e10 silent steps
    "{% set xs = range(100000) | list %}{% for a in xs %}{% for b in xs %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # 100 MB of output
    "{{ 'x' * 10**10 }}",
    "{{ 10 ** (10 ** 12) }}",  # jinja's ** is left-associative, hence the parentheses
    "{{ 'x' | center(10**10) }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s }}",  # doubling a string: caught when it is read back, long before memory runs out
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_fail_fast(template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template_module, "RENDER_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, {"messages": [USER]})
    assert time.monotonic() - start < 1.5


def test_default_timeout_bounds_a_silent_loop() -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 2s"):
        render_chat_template(HOSTILE[2], {})
    assert time.monotonic() - start < chat_template_module.RENDER_TIMEOUT_S + 1.0


def test_large_but_legitimate_prompts_render(ours: Tokenizer) -> None:
    # The size budget grows with the input, so a long document is not mistaken for an attack.
    big = {"role": "user", "content": "word " * 400_000}
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert len(ours.apply_chat_template([big], chat_template=template)) == 2_000_000


def test_compiled_templates_are_cached(ours: Tokenizer) -> None:
    chat_template_module._compile.cache_clear()
    for _ in range(3):
        ours.apply_chat_template([USER])
    info = chat_template_module._compile.cache_info()
    assert (info.misses, info.hits) == (1, 2)
