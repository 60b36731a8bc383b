"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of a
list of strings, or a grammar. Pure data, no grammar engine here (request.py holds one of
these, and the scheduler side stays free of native code).

The field names are vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`, `disable_any_whitespace`); OpenAI's `response_format` is translated into the
same object by the server. Sizes are bounded here because compiling a grammar costs time and
memory in proportion to its text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_SCHEMA_CHARS = 64 * 1024
MAX_REGEX_CHARS = 8 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 * 1024  # all choices together
# vLLM's older request fields, each one of the constraint kinds below.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredOutputsError(ValueError):
    """A structured-output request that cannot be served; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Exactly one of the constraint fields is set."""

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style), as llama.cpp and xgrammar read it
    json_object: bool | None = None  # any JSON object (OpenAI's {"type": "json_object"})
    # fornax's default is no free whitespace between JSON tokens: small models given the
    # choice tend to emit newlines and spaces until max_tokens. The JSON is valid either way.
    disable_any_whitespace: bool = True
    # Where the constraint came from, for error messages ("response_format", "structured_outputs").
    origin: str = field(default="structured_outputs", compare=False)
    # Text the output writes before the constraint starts: a reasoning model's `</think>`, so
    # the thinking is free and the answer after it is constrained. None: from the first token.
    starts_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            text = self.json
            if len(text) > MAX_SCHEMA_CHARS:
                raise self._error("json", f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
            try:
                self.json = json.loads(text)
            except ValueError as exc:
                raise self._error("json", f"the JSON schema is not valid JSON: {exc}") from None
        self.validate()

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            if getattr(self, name) not in (None, False):
                return name
        return "none"

    def param_for(self, name: str) -> str:
        """The request field an error about `name` points at: structured_outputs.<name>, or the
        field the constraint came from (response_format.json_schema, guided_regex, tools)."""
        return f"{self.origin}.{name}" if self.origin == "structured_outputs" else self.origin

    def _error(self, name: str, message: str) -> StructuredOutputsError:
        return StructuredOutputsError(self.param_for(name), message)

    def validate(self) -> None:
        kinds = [
            n
            for n in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, n) not in (None, False)
        ]
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise StructuredOutputsError(
                self.origin,
                f"exactly one of json, regex, choice, grammar, json_object must be set (got {found})",
            )
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise self._error("json", "the JSON schema must be an object")
        if self.json is not None and len(json.dumps(self.json)) > MAX_SCHEMA_CHARS:
            raise self._error("json", f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
        if self.regex is not None:
            _check_text(self, "regex", self.regex, MAX_REGEX_CHARS)
        if self.grammar is not None:
            _check_text(self, "grammar", self.grammar, MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            choices = self.choice
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise self._error("choice", "choice must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES or sum(len(c) for c in choices) > MAX_CHOICE_CHARS:
                raise self._error(
                    "choice", f"at most {MAX_CHOICES} choices of {MAX_CHOICE_CHARS} characters in all"
                )

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar (schemas compare by content, not key order)."""
        kind = self.kind
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
        return kind, text, self.disable_any_whitespace


def _check_text(params: StructuredOutputsParams, name: str, value: Any, limit: int) -> None:
    if not isinstance(value, str) or not value:
        raise params._error(name, f"{name} must be a non-empty string")
    if len(value) > limit:
        raise params._error(name, f"{name} is longer than {limit} characters")
