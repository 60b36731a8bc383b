"""The reasoning split (fornax/tools/reasoning.py) and the splitter that puts tool calls after it
(fornax/tools/output.py): the same text gives the same split however it is cut, and each format
reads the cases its models write."""

from __future__ import annotations

import pytest

from fornax.tools import make_parser
from fornax.tools.output import OutputSplitter, split_complete
from fornax.tools.reasoning import (
    REASONING_FORMATS,
    ReasoningParser,
    default_reasoning_parser,
    opened_by_prompt,
    reasoning_format,
)

# (format, opened by the prompt, generated text, expected reasoning, expected answer)
CASES = [
    (
        "qwen3",
        False,
        "<think>\nLet me add: 2+2=4.\n</think>\n\nThe answer is 4.",
        "Let me add: 2+2=4.\n",
        "The answer is 4.",
    ),
    ("qwen3", False, "  <think>short</think>done", "short", "done"),
    (
        "qwen3",
        False,
        "No thinking here, <think> is just text.",
        "",
        "No thinking here, <think> is just text.",
    ),
    ("qwen3", False, "<thin", "", "<thin"),  # a tag that never completes is answer text
    ("qwen3", False, "<think>cut off while thinking", "cut off while thinking", ""),
    ("qwen3", False, "", "", ""),
    ("qwen3", True, "I was asked to think.</think>Answer.", "I was asked to think.", "Answer."),
    ("qwen3", False, "<think></think>empty", "", "empty"),
    ("qwen3", False, "<think>a</think>b</think>c", "a", "b</think>c"),  # one span: later tags are text
    ("qwen3", False, "<think>x <th </thi </think>y", "x <th </thi ", "y"),
    (
        "deepseek_r1",
        False,
        "Reasoning without the tag.</think>The answer.",
        "Reasoning without the tag.",
        "The answer.",
    ),
    ("deepseek_r1", False, "<think>\nwith the tag</think>\nok", "with the tag", "ok"),  # repeated tag dropped
    ("deepseek_r1", False, "never closed", "never closed", ""),
    ("deepseek_r1", True, "\n\nstep one</think>\n\nüñí ok", "step one", "üñí ok"),
]


def _parser(name: str, opened: bool) -> ReasoningParser:
    return ReasoningParser(reasoning_format(name), opened)


def _run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, answer = [], []
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = parser.finish()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "answer"), CASES)
def test_split_whole_and_cut_at_every_boundary(fmt, opened, text, reasoning, answer) -> None:
    assert _run(_parser(fmt, opened), [text]) == (reasoning, answer)
    for cut in range(len(text) + 1):  # in two pieces, at every character
        assert _run(_parser(fmt, opened), [text[:cut], text[cut:]]) == (reasoning, answer), cut
    assert _run(_parser(fmt, opened), list(text)) == (reasoning, answer)  # one character at a time


def test_nothing_held_back_longer_than_a_tag_could_be() -> None:
    parser = _parser("qwen3", True)
    assert parser.feed("thinking </") == ("thinking ", "")  # "</" may start </think>
    assert parser.feed("b> more") == ("</b> more", "")
    assert parser.feed("</think>answer") == ("", "answer")
    assert parser.in_answer


def test_the_prompt_can_open_the_span() -> None:
    fmt = reasoning_format("qwen3")
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n", fmt)
    assert not opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n", fmt)  # switched off
    assert not opened_by_prompt("<|im_start|>assistant\n", fmt)
    assert _run(fmt.new_parser("assistant: <think>\n"), ["a</think>b"]) == ("a", "b")
    assert _run(fmt.new_parser("assistant:"), ["a</think>b"]) == ("", "a</think>b")


def test_the_template_picks_the_format() -> None:
    assert default_reasoning_parser(None) is None
    assert default_reasoning_parser("{{ messages }}") is None
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert default_reasoning_parser(qwen3) == "qwen3"
    assert (
        default_reasoning_parser("{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}</think>")
        == "deepseek_r1"
    )
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("nope")
    assert set(REASONING_FORMATS) == {"qwen3", "deepseek_r1"}


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_are_read_from_the_answer_only() -> None:
    text = f"<think>I could write {CALL} but first I think.</think>{CALL}"
    for cut in range(len(text) + 1):
        splitter = OutputSplitter(_parser("qwen3", False), make_parser("hermes"))
        pieces = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        reasoning = "".join(p.reasoning for p in pieces)
        assert reasoning == f"I could write {CALL} but first I think."
        assert "".join(p.content for p in pieces).strip() == ""
        assert splitter.called
    whole = split_complete(OutputSplitter(_parser("qwen3", False), make_parser("hermes")), text)
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", '{"city": "Paris"}')]
    assert whole.reasoning == f"I could write {CALL} but first I think."


def test_a_call_only_thought_about_is_no_call() -> None:
    whole = split_complete(
        OutputSplitter(_parser("qwen3", True), make_parser("hermes")), f"{CALL}</think>No."
    )
    assert whole.calls == [] and whole.content == "No." and whole.reasoning == CALL


def test_dropped_reasoning_stays_out_of_the_answer() -> None:
    splitter = OutputSplitter(_parser("qwen3", False), keep_reasoning=False)
    whole = split_complete(splitter, "<think>private</think>public")
    assert whole.reasoning is None and whole.content == "public"


def test_without_parsers_the_text_is_all_answer() -> None:
    whole = split_complete(OutputSplitter(), "<think>a</think>b")
    assert (whole.reasoning, whole.content, whole.calls) == (None, "<think>a</think>b", [])
