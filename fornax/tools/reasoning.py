"""Reasoning split from the answer: the `<think>...</think>` span Qwen3, DeepSeek-R1 (and its
distills) and QwQ write before they answer.

Every API shows the two apart: chat as `reasoning_content`, Responses as a reasoning item,
Messages as a thinking block (docs/usage.md). The split is made on text as it streams, so a
tag cut across two engine outputs is held back until it is whole: the same text gives the same
split however it was cut (tests/tools/test_reasoning.py cuts it at every character).

Two formats, named as vLLM and SGLang name their parsers:
- `qwen3`: the answer may open with `<think>`; without it, the whole output is answer (a
  template switched to no thinking writes an empty, closed span into the prompt itself).
- `deepseek_r1`: the output is reasoning from its first token until `</think>`, whether or not
  the model repeats the `<think>` its template already opened; with no `</think>` at all,
  all of it is reasoning (the model was cut off while thinking).
Either way, a prompt that ends inside an open `<think>` starts the output in reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from fornax.tools.calls import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool  # no start tag needed: the output opens inside the reasoning
    start: str = START
    end: str = END

    def new_parser(self, prompt_text: str = "") -> ReasoningParser:
        """A parser for one generated sequence; `prompt_text` is the rendered prompt (its end
        says whether the template opened the reasoning span itself)."""
        return ReasoningParser(self, opened_by_prompt(prompt_text, self))


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", starts_in_reasoning=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
}


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_FORMATS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None


def default_reasoning_parser(template: str | None) -> str | None:
    """The format a chat template implies: none unless it knows the think tags; Qwen3's
    templates carry the `enable_thinking` switch, DeepSeek-R1's open the span themselves."""
    if not template or END not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"


def opened_by_prompt(prompt_text: str, fmt: ReasoningFormat) -> bool:
    """Whether the prompt ends inside a reasoning span its template opened (`...<think>\\n`)."""
    tail = prompt_text.rstrip()
    return tail.endswith(fmt.start)


class ReasoningParser:
    """Splits one sequence's text, fed piece by piece, into (reasoning, answer) pieces.

    States: `before` (nothing but whitespace yet, and the start tag may still come), `reasoning`
    and `answer`; from `before`, untagged text goes where the prompt or the format left off.
    Whitespace right after either tag is dropped, as the peers do, so the answer does not open
    with the blank line templates put after `</think>`.
    """

    def __init__(self, fmt: ReasoningFormat, opened: bool = False) -> None:
        self.fmt = fmt
        # Where text goes if it does not open with the start tag: into the reasoning when the
        # prompt or the format already opened it (a repeated start tag is then dropped).
        self._untagged = "reasoning" if opened or fmt.starts_in_reasoning else "answer"
        self.state = "before"
        self._held = ""  # text not yet given out: a tag may be starting in it
        self._skip_space = False

    @property
    def in_answer(self) -> bool:
        return self.state == "answer"

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) text that `text` completes; a possible tag is held back."""
        return self._run(self._held + text, final=False)

    def finish(self) -> tuple[str, str]:
        """Whatever is held back, at the end of the sequence."""
        return self._run(self._held, final=True)

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning: list[str] = []
        answer: list[str] = []
        while text:
            if self._skip_space:
                stripped = text.lstrip()
                if not stripped:
                    return "".join(reasoning), "".join(answer)  # all whitespace: still skipping
                text, self._skip_space = stripped, False
            if self.state == "before":
                body = text.lstrip()
                if body.startswith(self.fmt.start):
                    text, self.state = body[len(self.fmt.start) :], "reasoning"
                    self._skip_space = True
                elif self.fmt.start.startswith(body) and not final:
                    self._held = text  # "<thi": the tag may be coming
                    break
                else:
                    self.state = self._untagged
                    self._skip_space = self.state == "reasoning"
            elif self.state == "reasoning":
                at = text.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(text[:at])
                    text, self.state, self._skip_space = text[at + len(self.fmt.end) :], "answer", True
                    continue
                keep = 0 if final else partial_suffix(text, self.fmt.end)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            else:
                answer.append(text)
                break
        return "".join(reasoning), "".join(answer)
