"""Tool calls pulled out of generated text, incrementally, in OpenAI's shapes.

A model "calls a tool" by writing text in a format its chat template taught it (hermes' `<tool_call>`
blocks, Llama 3's bare JSON, ...). One `ToolCallParser` per generated sequence reads that text as it
is produced and splits it into content to stream now and `ToolCallDelta` fragments shaped like
OpenAI's streamed `delta.tool_calls`.

The non-streamed response is assembled from the very same fragments (`parse_complete`), so a client
gets the same name and the same arguments string whichever way it asked. That only holds if every
decision a parser makes depends on the text, never on how the text was split into deltas; each
decision below is written to be prefix-stable for that reason (a test splits texts at random).

Once a call's header has been streamed it cannot be taken back: if the rest of the call turns out
malformed (arguments that never close, junk after them), the call stays a call with whatever
arguments text was streamed. Other OpenAI-compatible servers do the same; the alternative would be
to hold every call back until it is complete, which defeats streaming.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PARSERS",
    "HermesParser",
    "JsonArrayParser",
    "Llama3JsonParser",
    "NamedParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "make_parser",
    "new_call_id",
    "parse_complete",
]

_ID_ALPHABET = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()

# The start of a call object whose name is known before its arguments: `{"name": "<string>",
# "arguments": ` followed by the `{` that opens the arguments object. The lookahead makes a match
# mean "the arguments value has begun and is an object", so streaming it raw is safe. Every part is
# determined by the text before it, so a prefix of the body matches exactly when the whole body does.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def new_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One complete call, as the non-streamed response carries it."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ToolCallDelta:
    """One streamed fragment, as OpenAI streams `delta.tool_calls[i]`."""

    index: int  # which call (0, 1, ...) of this choice
    id: str | None = None  # only on a call's first fragment
    name: str | None = None  # only on a call's first fragment
    arguments: str = ""  # a piece of the arguments JSON text


class ToolCallParser:
    """Base of the parsers: one instance per choice, fed that choice's text as it is generated."""

    def __init__(self) -> None:
        self._calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New model text in; out: the content to stream now and the call fragments to stream now.

        Within one feed the order of content and fragments is not kept (a delta carries both
        fields); across feeds it is.
        """
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: whatever was held back, settled as content or calls."""
        raise NotImplementedError

    @property
    def called(self) -> bool:
        """True once a call was emitted; the choice's finish_reason is then "tool_calls"."""
        return self._calls > 0

    def _start_call(self, name: str, arguments: str = "") -> ToolCallDelta:
        """The first fragment of the next call. Indexes are handed out here, when a call is certain,
        so a block that turns out not to be a call never leaves a gap in them."""
        delta = ToolCallDelta(index=self._calls, id=new_call_id(), name=name, arguments=arguments)
        self._calls += 1
        return delta


def _call_from_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from a whole call object, or None when the text is not one.

    Used when the header was never recognised (keys in another order, say). Arguments may be
    missing (no parameters: `{}`) or, as some models write them, a string holding a JSON object.
    """
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class _CallBody:
    """The text of one call being streamed: header fragment first, then the arguments as they come.

    With `name` unknown the body is a call object (`{"name": ..., "arguments": {...}}`); with `name`
    given (a grammar forced that function) the body is the arguments object itself.
    """

    def __init__(self, owner: ToolCallParser, name: str | None = None) -> None:
        self._owner = owner
        self._known_name = name
        self.text = ""
        self._index: int | None = None  # set once the header fragment went out
        self._args_start = 0
        self._args_end: int | None = None  # where the arguments object ends, once it has
        self._streamed = 0  # how far into `text` the arguments were streamed

    @property
    def started(self) -> bool:
        return self._index is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        if self._index is not None:
            return self._args_delta()
        if self._known_name is not None:
            # Leading whitespace is not part of the arguments; wait for the first real character.
            stripped = self.text.lstrip()
            if not stripped:
                return []
            self._args_start = self._streamed = len(self.text) - len(stripped)
            header = self._owner._start_call(self._known_name, self._next_args())
            self._index = header.index
            return [header]
        match = _HEADER.match(self.text)
        if match is None:
            return []
        try:
            name = json.loads(match.group(1))
        except ValueError:  # a string the regex allows but JSON does not (raw control characters)
            return []
        if not name:
            return []
        self._args_start = self._streamed = match.end()
        header = self._owner._start_call(name)
        self._index = header.index
        return [header, *self._args_delta()]

    def object_end(self) -> int | None:
        """Where the body's top-level JSON value ends, for formats whose calls are not delimited by
        tags; None while it is incomplete (or malformed, which looks the same until the end)."""
        start = len(self.text) - len(self.text.lstrip())
        try:
            return _DECODER.raw_decode(self.text, start)[1]
        except ValueError:
            return None

    def cut(self, end: int) -> str:
        """Ends the body at `end`; returns the text after it, which belongs to whatever follows."""
        rest, self.text = self.text[end:], self.text[:end]
        return rest

    def close(self) -> list[ToolCallDelta] | None:
        """The body is complete (or generation ended). Fragments still owed, or None when the body
        never became a call: the caller then hands its text back as content."""
        if self._index is not None:
            return self._args_delta()
        if self._known_name is not None:
            return []  # nothing but whitespace was generated: no call, and no content either
        call = _call_from_object(self.text)
        if call is None:
            return None
        name, arguments = call
        header = self._owner._start_call(name)
        return [header, ToolCallDelta(index=header.index, arguments=arguments)]

    def _next_args(self) -> str:
        """The arguments text not yet streamed. Until the object decodes, everything received is
        inside it (an object cannot have ended before a decode succeeds); once it decodes, only
        up to its end, so the `}` and tags after it are never streamed as arguments."""
        if self._args_end is None and "}" in self.text[self._streamed :]:  # only `}` can complete it
            with contextlib.suppress(ValueError):
                self._args_end = _DECODER.raw_decode(self.text, self._args_start)[1]
        upto = len(self.text) if self._args_end is None else self._args_end
        piece = self.text[self._streamed : upto]
        self._streamed = max(self._streamed, upto)
        return piece

    def _args_delta(self) -> list[ToolCallDelta]:
        piece = self._next_args()
        assert self._index is not None
        return [ToolCallDelta(index=self._index, arguments=piece)] if piece else []


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (held back until the
    next text says whether it is the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser(ToolCallParser):
    """Calls written as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
    (Hermes, Qwen 2.5/3 and others), with free text before, between and after them."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # received text not yet given to content or to a call
        self._call: _CallBody | None = None  # the block being read, if inside one

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._call is None:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, self.OPEN)
                    content.append(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(self.OPEN) :]
                self._call = _CallBody(self)
            else:
                at = self._buf.find(self.CLOSE)
                if at < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, self.CLOSE)
                    deltas += self._call.feed(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                deltas += self._call.feed(self._buf[:at])
                self._buf = self._buf[at + len(self.CLOSE) :]
                self._end_call(content, deltas, closed=True)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._call is None:
            content.append(self._buf)  # a held-back `<tool_` that never became a tag
        else:
            deltas += self._call.feed(self._buf)
            self._end_call(content, deltas, closed=False)
        self._buf = ""
        return "".join(content), deltas

    def _end_call(self, content: list[str], deltas: list[ToolCallDelta], closed: bool) -> None:
        assert self._call is not None
        owed = self._call.close()
        if owed is None:  # not a call: the model's text goes back to it as it was written
            content.append(self.OPEN + self._call.text + (self.CLOSE if closed else ""))
        else:
            deltas += owed
        self._call = None


class _JsonSequenceParser(ToolCallParser):
    """Calls written as bare JSON objects in a row, after a prelude, with a separator between them
    and maybe a closing character. Subclasses give the prelude, separator and closer.

    Whitespace between calls is dropped. Text that does not fit the format is content, from the
    first character that does not fit to the end (a call already streamed stays a call).
    """

    SEPARATOR = ","
    CLOSER: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "prelude"  # prelude | expect | object | after | done | content
        self._call: _CallBody | None = None

    def _prelude(self, text: str, final: bool) -> int | None:
        """Where the first call object may start; -1 when the text is not calls at all; None while
        undecided (never when `final`)."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self._advance(final=True)
        if self._call is not None:
            owed = self._call.close()
            if owed is None:
                content += self._call.text
            else:
                deltas += owed
            self._call = None
        self._buf = ""
        return content, deltas

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._state == "content":
                content.append(self._buf)
                self._buf = ""
                break
            if self._state == "prelude":
                start = self._prelude(self._buf, final)
                if start is None:
                    break
                if start < 0:
                    self._state = "content"
                else:
                    self._buf = self._buf[start:]
                    self._state = "expect"
                continue
            if self._state == "object":
                assert self._call is not None
                chunk, self._buf = self._buf, ""
                deltas += self._call.feed(chunk)
                end = self._call.object_end() if "}" in chunk else None  # only a `}` can end it
                if end is None:
                    break
                self._buf = self._call.cut(end)
                owed = self._call.close()
                if owed is None:  # a JSON object, but not a call: it and the rest are content
                    content.append(self._call.text)
                    self._state = "content"
                else:
                    deltas += owed
                    self._state = "after"
                self._call = None
                continue
            # expect / after / done: whitespace is skipped, one character decides what comes next
            self._buf = self._buf.lstrip()
            if not self._buf:
                break
            first = self._buf[0]
            if self._state == "expect" and first == "{":
                self._state = "object"
                self._call = _CallBody(self)
            elif self._state in ("expect", "after") and self.CLOSER is not None and first == self.CLOSER:
                self._buf = self._buf[1:]
                self._state = "done"
            elif self._state == "after" and first == self.SEPARATOR:
                self._buf = self._buf[1:]
                self._state = "expect"
            else:
                self._state = "content"
        return "".join(content), deltas


class Llama3JsonParser(_JsonSequenceParser):
    """Llama 3.x's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (or
    several, separated by `;`), after optional whitespace and an optional `<|python_tag|>`. Output
    that starts any other way is plain content, streamed at once."""

    SEPARATOR = ";"
    PYTHON_TAG = "<|python_tag|>"

    def _prelude(self, text: str, final: bool) -> int | None:
        rest = text.lstrip()
        if rest.startswith(self.PYTHON_TAG):
            rest = rest[len(self.PYTHON_TAG) :].lstrip()
        elif rest and self.PYTHON_TAG.startswith(rest) and not final:
            return None  # could still become the tag
        if not rest:
            return -1 if final else None
        return len(text) - len(rest) if rest[0] == "{" else -1


class JsonArrayParser(_JsonSequenceParser):
    """A JSON array of call objects, `[{"name": ..., "arguments": {...}}, ...]`: what the grammar for
    tool_choice="required" produces."""

    SEPARATOR = ","
    CLOSER = "]"

    def _prelude(self, text: str, final: bool) -> int | None:
        rest = text.lstrip()
        if not rest:
            return -1 if final else None
        return len(text) - len(rest) + 1 if rest[0] == "[" else -1


class NamedParser(ToolCallParser):
    """tool_choice named one function and a grammar forced the output to be its arguments object:
    everything generated is that call's arguments, and nothing is content."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._call = _CallBody(self, name=name)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return "", self._call.feed(text)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", self._call.close() or []


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "json_array": JsonArrayParser,
    "named": NamedParser,
}


def make_parser(name: str, /, **kw: Any) -> ToolCallParser:
    """A new parser of the format `name` (positional, so that `named` can take the function's `name=`)."""
    try:
        cls = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
    return cls(**kw)


def parse_complete(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole generated text at once: (content or None when blank, calls). Built from the same
    fragments that streaming emits, so both responses agree."""
    content, deltas = parser.feed(text)
    tail, more = parser.finish()
    content += tail
    return (content if content.strip() else None), parse_fragments([*deltas, *more])


def parse_fragments(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Streamed call fragments joined into whole calls, in call order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = ToolCall(id=delta.id, name=delta.name or "", arguments=delta.arguments)
        else:
            calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]
