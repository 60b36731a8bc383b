"""Pydantic models of OpenAI's Responses API requests (`POST /v1/responses`) and of the input
items they carry; server/openai_responses.py reads them into a chat turn.

Like the other request models (server/protocol.py) they ignore unknown fields and refuse wrong
types and NaN. Fields fornax cannot honour but that would change the answer if ignored
(`background`, `conversation`, `prompt`, `include`, `truncation: auto`, ...) are read only so
that the route can refuse them by name. `input` is kept as plain JSON here and each item is
checked by its own model (`INPUT_ITEMS`), so that an error names the item (`input.3.call_id`)
instead of listing every branch of a union.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's bounds on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_In):
    """A text content part: `input_text` in user turns, `output_text` in the assistant's."""

    type: str
    text: str | None = None


class MessageItem(_In):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_In):
    """A call the model made in an earlier turn, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(default="{}", max_length=1 << 20)  # JSON text


class FunctionCallOutputItem(_In):
    """A tool's result for a call, matched to it by `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


class ReasoningInputItem(_In):
    """An earlier turn's reasoning: accepted and left out of the prompt, as chat templates
    leave earlier turns' thinking out."""

    type: Literal["reasoning"]


# Each item type the input may hold, by its `type` (a message may leave `type` out).
INPUT_ITEMS: dict[str, type[_In]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningInputItem,
}


class TextFormat(_In):
    type: Literal["text", "json_schema", "json_object"]
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` is a BaseModel attribute; the alias keeps OpenAI's key on the wire.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_In):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint fornax's models do not take


class ReasoningConfig(_In):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: the reasoning is whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_In):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Function tools ({type: function, name, description, parameters, strict}), checked by the route.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    stream: bool = False
    user: str | None = None
    # vLLM's and fornax's sampling extensions, as on chat completions.
    structured_outputs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused when set (server/openai_responses.py, _refuse_unsupported): honouring them is not
    # possible here, and ignoring them would answer something else than was asked.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    context_management: list[dict[str, Any]] | None = None
