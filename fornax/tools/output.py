"""One generated sequence read into what every API shows apart: reasoning, answer text, and
tool calls. The reasoning parser goes first; tool calls are read from the answer only, so a
call the model merely thinks about is not made.

Streamed and whole replies use the same pieces: `split_complete` feeds the whole text through
the streaming path, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fornax.tools.calls import ToolCall, ToolCallDelta, ToolCallParser, parse_fragments
from fornax.tools.reasoning import ReasoningParser


@dataclass
class Piece:
    """What one stretch of text added: reasoning, answer text, call fragments (any may be empty)."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class OutputSplitter:
    """Splits one sequence's text as it streams (either parser may be absent)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        keep_reasoning: bool = True,
    ) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.keep_reasoning = keep_reasoning  # false: split off, and dropped

    @property
    def called(self) -> bool:
        """Whether any tool call was started."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> Piece:
        thought, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return Piece(thought if self.keep_reasoning else "") + self._answer(answer, final=False)

    def finish(self) -> Piece:
        thought, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return Piece(thought if self.keep_reasoning else "") + self._answer(answer, final=True)

    def _answer(self, text: str, final: bool) -> Piece:
        if self.tools is None:
            return Piece(content=text)
        content, calls = self.tools.feed(text) if text else ("", [])
        if final:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        return Piece(content=content, calls=calls)


@dataclass
class SplitText:
    """A whole sequence, split. `reasoning` is None when there was none (or only whitespace);
    `content` is the answer text as generated, possibly empty."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]


def split_complete(splitter: OutputSplitter, text: str) -> SplitText:
    whole = splitter.feed(text) + splitter.finish()
    return SplitText(
        reasoning=whole.reasoning if whole.reasoning.strip() else None,
        content=whole.content,
        calls=parse_fragments(whole.calls),
    )
