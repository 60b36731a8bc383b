"""fornax.tools: reading tool calls out of generated text, and tools in the prompt."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from fornax.tools import (
    PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolsError,
    check_tools,
    default_parser,
    forced_tool_schema,
    make_parser,
    parse_complete,
    prepare_messages,
    template_supports_tools,
)

# ---- helpers -------------------------------------------------------------------------------------


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    """Feeds the pieces one by one, then finish(); all content and all fragments, in order."""
    content, deltas = [], []
    for piece in pieces:
        text, more = parser.feed(piece)
        content.append(text)
        deltas += more
    text, more = parser.finish()
    content.append(text)
    return "".join(content), deltas + more


def assemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) per call, as a streaming client would rebuild them; checks the fragment
    protocol on the way: ids and names on first fragments only, indexes 0, 1, ... in order."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls), "a new call must take the next index"
            assert d.name
            calls.append([d.name, d.arguments])
        else:
            assert d.name is None
            assert d.index == len(calls) - 1, "fragments continue the latest call"
            calls[d.index][1] += d.arguments
    return [(name, args) for name, args in calls]


def complete(parser_name: str, text: str, **kw: object) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_complete(make_parser(parser_name, **kw), text)
    return content, [(c.name, c.arguments) for c in calls]


def by_char(parser_name: str, text: str, **kw: object) -> tuple[str, list[ToolCallDelta]]:
    return stream(make_parser(parser_name, **kw), list(text))


# ---- hermes --------------------------------------------------------------------------------------

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def test_hermes_text_before_and_after_a_call():
    content, calls = complete("hermes", "Let me look.\n" + WEATHER + "\nDone.")
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert content == "Let me look.\n\nDone."


def test_hermes_plain_text_is_all_content():
    parser = make_parser("hermes")
    assert parse_complete(parser, "Just an answer, 1 < 2.") == ("Just an answer, 1 < 2.", [])
    assert not parser.called


def test_hermes_two_calls():
    second = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    parser = make_parser("hermes")
    content, calls = parse_complete(parser, WEATHER + "\n" + second)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert content is None  # only the newline between the blocks
    assert parser.called


def test_hermes_streams_header_then_raw_arguments():
    parser = make_parser("hermes")
    assert parser.feed("Sure. <tool_call>\n{") == ("Sure. ", [])
    text, deltas = parser.feed('"name": "get_weather", "arguments": {"ci')
    assert text == ""
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", ""), (0, None, '{"ci')]
    assert deltas[0].id is not None and deltas[1].id is None
    _, deltas = parser.feed('ty": "Paris"}}\n</tool_call>')
    # the object's end is found: the outer `}` and the closing tag are not arguments
    assert [d.arguments for d in deltas] == ['ty": "Paris"}']
    assert parser.called


def test_hermes_holds_back_a_partial_tag():
    parser = make_parser("hermes")
    assert parser.feed("Checking <tool_") == ("Checking ", [])
    # it was a tag after all: nothing of it is ever content
    text, deltas = parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert text == ""
    assert assemble(deltas) == [("f", "{}")]

    parser = make_parser("hermes")
    assert parser.feed("a <tool_") == ("a ", [])
    assert parser.feed("box> b") == ("<tool_box> b", [])  # not a tag: released as content
    assert parser.feed("<") == ("", [])
    assert parser.finish() == ("<", [])  # end of generation releases what was held


def test_hermes_partial_closing_tag_inside_a_call():
    parser = make_parser("hermes")
    parser.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool')
    text, _deltas = parser.feed("_call>after")
    assert text == "after"
    assert parser.called


def test_hermes_invalid_body_is_content():
    text = 'Hmm <tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call> ok'
    parser = make_parser("hermes")
    _content, calls = parse_complete(parser, text)
    # the header was recognised, so the call was already streamed and stays a call...
    assert [c.name for c in calls] == ["f"]

    # ...but a body that never looked like a call comes back as text, tags and all
    garbage = "Hmm <tool_call>\nnot json at all\n</tool_call> ok"
    parser = make_parser("hermes")
    assert parse_complete(parser, garbage) == (garbage, [])
    assert not parser.called
    nameless = '<tool_call>{"arguments": {"a": 1}}</tool_call>'
    assert complete("hermes", nameless) == (nameless, [])
    not_object_args = '<tool_call>{"arguments": [1], "name": "f"}</tool_call>'
    assert complete("hermes", not_object_args) == (not_object_args, [])


def test_hermes_unterminated_call_at_finish():
    # complete JSON without the closing tag: a call
    assert complete("hermes", 'x <tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n') == (
        "x ",
        [("f", '{"a": 1}')],
    )
    # incomplete JSON that never showed a header: the text is content again
    cut = 'x <tool_call>\n{"arguments": {"a": 1'
    assert complete("hermes", cut) == (cut, [])
    # header streamed, then generation stopped (max_tokens): the call stays, with what was streamed
    assert complete("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1') == (None, [("f", '{"a": 1')])


def test_hermes_keys_out_of_order_and_parameters_key():
    content, calls = complete("hermes", '<tool_call>{"arguments": {"q": "é"}, "name": "search"}</tool_call>')
    assert calls == [("search", '{"q": "é"}')]
    assert content is None
    assert complete("hermes", '<tool_call>{"name": "f", "parameters": {"n": 2}}</tool_call>') == (
        None,
        [("f", '{"n": 2}')],
    )
    # without arguments at all: no parameters
    assert complete("hermes", '<tool_call>{"name": "ping"}</tool_call>') == (None, [("ping", "{}")])


def test_hermes_arguments_are_streamed_verbatim():
    args = '{"s": "a}b\\"c</tool", "n": [1, {"m": null}],\n "u": "\\u00e9"}'
    _content, calls = complete("hermes", f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>')
    assert calls == [("f", args)]
    assert json.loads(calls[0][1])["s"] == 'a}b"c</tool'


# ---- llama3_json ---------------------------------------------------------------------------------


def test_llama3_single_call():
    assert complete("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        None,
        [("get_weather", '{"city": "Oslo"}')],
    )
    assert complete("llama3_json", '\n<|python_tag|>{"name": "f", "arguments": {}}') == (None, [("f", "{}")])


def test_llama3_multiple_calls():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2]}}'
    assert complete("llama3_json", text) == (None, [("a", '{"x": 1}'), ("b", '{"y": [2]}')])


def test_llama3_not_a_call_is_content_at_once():
    parser = make_parser("llama3_json")
    assert parser.feed("  The answer") == ("  The answer", [])  # decided by the first character
    assert parser.feed(" is {42}.") == (" is {42}.", [])
    assert parser.finish() == ("", [])
    assert not parser.called
    # a JSON object that is not a call is content too
    assert complete("llama3_json", '{"answer": 42}') == ('{"answer": 42}', [])


def test_llama3_waits_on_whitespace_and_a_partial_python_tag():
    parser = make_parser("llama3_json")
    assert parser.feed("\n") == ("", [])
    assert parser.feed("<|python") == ("", [])
    _, deltas = parser.feed('_tag|>{"name": "f", "parameters": {"a"')
    assert [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"a"')]


def test_llama3_text_after_a_call_is_content():
    assert complete("llama3_json", '{"name": "f", "parameters": {}} and then') == (
        "and then",
        [("f", "{}")],
    )


# ---- json_array / named --------------------------------------------------------------------------


def test_json_array_calls():
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    parser = make_parser("json_array")
    content, calls = parse_complete(parser, text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    _, deltas = by_char("json_array", text)
    assert assemble(deltas) == [("a", '{"x": 1}'), ("b", "{}")]


def test_named_call():
    parser = make_parser("named", name="get_weather")
    text, deltas = parser.feed('{"city": ')
    assert text == ""
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": ')]
    assert deltas[0].id is not None
    assert parser.feed('"Rome"}') == ("", [ToolCallDelta(index=0, arguments='"Rome"}')])
    assert parser.finish() == ("", [])
    assert parser.called
    assert complete("named", '{"a": 1}', name="f") == (None, [("f", '{"a": 1}')])
    assert complete("named", "", name="f") == (None, [])


# ---- streamed == complete ------------------------------------------------------------------------

SAMPLES = [
    ("hermes", "Let me look.\n" + WEATHER + "\nDone."),
    ("hermes", WEATHER + "\n" + WEATHER.replace("Paris", "Lyon")),
    ("hermes", 'x <tool_call>{"arguments": {"a": "}"}, "name": "f"}</tool_call> y <tool_'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'),
    ("hermes", "<tool_call>garbage</tool_call> then " + WEATHER),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "</tool_call"}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),
    ("hermes", '<tool_call>{"name": "f\\n", "parameters": {"a": "é\\u00e9"}}</tool_call>'),
    ("hermes", "a < b <tool_call <tool_call>\n"),
    (
        "llama3_json",
        ' <|python_tag|>{"name": "a", "parameters": {"x": "}{"}};{"name": "b", "parameters": {}}',
    ),
    ("llama3_json", '{"parameters": {"x": 1}, "name": "a"} ; {"name": "b", "parameters": {"y": 2}} tail'),
    ("llama3_json", "<|python_tag|> hello {}"),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}'),
    ("json_array", '[ {"name": "a", "arguments": {"x": [1, 2]}} , {"arguments": {}, "name": "b"} ]'),
    ("json_array", '[{"name": "a", "arguments": {"x": 1}}'),
]


@pytest.mark.parametrize(("parser_name", "text"), SAMPLES)
def test_streamed_equals_complete_for_random_splits(parser_name, text):
    rng = random.Random(1234)
    expected_content, expected_calls = complete(parser_name, text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, deltas = stream(make_parser(parser_name), pieces)
        assert assemble(deltas) == expected_calls, pieces
        assert (content if content.strip() else None) == expected_content, pieces
    # and one character at a time
    content, deltas = by_char(parser_name, text)
    assert assemble(deltas) == expected_calls


def test_named_streamed_equals_complete():
    rng = random.Random(7)
    text = '{"q": "x}y", "n": [1, 2, {"z": null}]}'
    expected = complete("named", text, name="f")
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, deltas = stream(make_parser("named", name="f"), pieces)
        assert content == ""
        assert assemble(deltas) == expected[1]


def test_call_ids_are_unique_and_well_formed():
    _, calls = parse_complete(make_parser("hermes"), WEATHER * 50)
    ids = [c.id for c in calls]
    assert len(calls) == 50
    assert len(set(ids)) == 50
    assert all(re.fullmatch(r"call_[a-zA-Z0-9]{24}", i) for i in ids)
    assert isinstance(calls[0], ToolCall)


def test_make_parser():
    assert set(PARSERS) == {"hermes", "llama3_json", "json_array", "named"}
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("nope")


# ---- prompt --------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
]


def test_prepare_messages_fallback():
    original = json.dumps(HISTORY)
    out = prepare_messages(HISTORY, TOOLS, template_supports=False)
    assert json.dumps(HISTORY) == original  # the input is left alone

    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n")  # merged into the existing system message
    tools_block = re.search(r"<tools>\n(.*)\n</tools>", system, re.S).group(1)
    assert [json.loads(line) for line in tools_block.splitlines()] == TOOLS
    assert "<tool_call>" in system and "</tool_call>" in system

    # earlier calls become text the hermes parser reads back as the same calls
    assistant = out[2]
    assert "tool_calls" not in assistant
    content, calls = complete("hermes", assistant["content"])
    assert content is None
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]

    # the two results are one user message
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\n14:00\n</tool_response>",
    }


def test_prepare_messages_fallback_inserts_a_system_message():
    out = prepare_messages([{"role": "user", "content": "hi"}], TOOLS, template_supports=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[1] == {"role": "user", "content": "hi"}
    # no tools: no instructions
    assert prepare_messages([{"role": "user", "content": "hi"}], None, False) == [
        {"role": "user", "content": "hi"}
    ]


def test_prepare_messages_when_the_template_supports_tools():
    out = prepare_messages(HISTORY, TOOLS, template_supports=True)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "tool"]
    assert out[0] == HISTORY[0]
    assert out[3] == HISTORY[3]
    calls = out[2]["tool_calls"]
    assert calls[0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert calls[1]["function"]["arguments"] == {}
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated


def test_template_supports_tools():
    with_tools = (
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    without = "{% for m in messages %}{% if m.role == 'x' %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert template_supports_tools(with_tools)
    assert not template_supports_tools(without)
    assert not template_supports_tools("{% for m in messages %}{{ m.tools }}{% endfor %}")  # an attribute
    assert not template_supports_tools("{% if tools %}")  # does not parse


def test_default_parser():
    assert default_parser(None) == "hermes"
    assert default_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_parser("{% if m.role == 'ipython' %}") == "llama3_json"
    assert default_parser("{{ '<|python_tag|>' }}") == "llama3_json"


def test_forced_tool_schema_required():
    schema, parser = forced_tool_schema(TOOLS, "required", parallel_tool_calls=True)
    assert parser == "json_array"
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],  # at least one call
        [{"name": "get_wether", "arguments": {"city": "Paris"}}],  # no such function
        [{"name": "get_weather", "arguments": {}}],  # its parameters are not met
        [{"name": "get_time", "arguments": {}, "extra": 1}],
        [{"name": "get_time", "arguments": 3}],  # arguments must be an object
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)

    single, _ = forced_tool_schema(TOOLS, "required", parallel_tool_calls=False)
    assert single["maxItems"] == 1
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    # what the grammar produces is what json_array reads
    assert complete("json_array", json.dumps(good))[1] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]


def test_forced_tool_schema_named_and_free():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_tool_schema(TOOLS, named, True) == (TOOLS[0]["function"]["parameters"], "named")
    schema, parser = forced_tool_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert (schema, parser) == ({"type": "object"}, "named")
    for free in (None, "none", "auto"):
        assert forced_tool_schema(TOOLS, free, True) is None


def test_check_tools_accepts_good_requests():
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        check_tools(TOOLS, choice)
    check_tools(None, None)
    check_tools([], "auto")


@pytest.mark.parametrize(
    ("tools", "choice", "param", "message"),
    [
        ({"type": "function"}, None, "tools", "must be an array"),
        (["x"], None, "tools[0]", "must be an object"),
        ([{"type": "retrieval"}], None, "tools[0].type", "must be 'function'"),
        ([{"type": "function"}], None, "tools[0].function", "must be an object"),
        (
            [TOOLS[0], {"type": "function", "function": {"name": "bad name"}}],
            None,
            "tools[1].function.name",
            "tools[1].function.name must be 1 to 64",
        ),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name", "1 to 64"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            "tools[0].function.description",
            "must be a string",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            None,
            "tools[0].function.parameters",
            "JSON schema object",
        ),
        ([*TOOLS, TOOLS[0]], None, "tools[2].function.name", "already the name of tools[0]"),
        (
            [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            None,
            "tools",
            "at most 128",
        ),
        (TOOLS, "sometimes", "tool_choice", "tool_choice must be"),
        (TOOLS, {"type": "function", "name": "get_time"}, "tool_choice", "tool_choice must be"),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice.function.name",
            "no function named 'nope'",
        ),
        (None, {"type": "function", "function": {"name": "f"}}, "tool_choice.function.name", "no tools"),
        ([], "required", "tool_choice", "at least one tool"),
    ],
)
def test_check_tools_errors(tools, choice, param, message):
    with pytest.raises(ToolsError, match=re.escape(message)) as info:
        check_tools(tools, choice)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
