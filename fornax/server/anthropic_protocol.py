"""Pydantic models of Anthropic's Messages API request (`POST /v1/messages` and
`/v1/messages/count_tokens`), as fornax reads it.

Kept apart from protocol.py (OpenAI's shapes) because the two APIs name the same things
differently; server/anthropic_messages.py translates this request into a chat completions
request. Like protocol.py, requests ignore unknown fields and refuse NaN and infinities.
Content blocks are read loosely (`type` plus every field any block type has) so that a block
fornax does not serve (an image, a document) is refused by name, with a message saying so,
rather than by a union's generic "no branch matched" (docs/usage.md lists what is served).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Request):
    """A block inside `system` or a tool_result's content: text is the only kind served there."""

    type: str = Field(max_length=64)
    text: str | None = None


class ContentBlock(_Request):
    """One block of a message's content; which fields matter depends on `type`."""

    type: str = Field(max_length=64)
    text: str | None = None  # text
    id: str | None = Field(default=None, max_length=256)  # tool_use
    name: str | None = Field(default=None, max_length=256)  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = Field(default=None, max_length=256)  # tool_result
    content: str | list[TextPart] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking (earlier turns: dropped from the prompt)
    signature: str | None = None


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(_Request):
    """A client tool. `type` is absent or "custom"; server tools (web_search, ...) are refused."""

    type: str | None = Field(default=None, max_length=64)
    name: str = Field(max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoiceParam(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=256)
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Request):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)  # accepted; not enforced (docs/usage.md)


class OutputFormat(_Request):
    type: Literal["json_schema"]
    # `schema` is a BaseModel attribute; the alias keeps Anthropic's key on the wire.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: OutputFormat | None = None


class MessagesCountTokensRequest(_Request):
    """What /v1/messages/count_tokens reads: everything that goes into the prompt."""

    model: str | None = None  # absent: the server's first model (Anthropic requires it)
    messages: list[MessageParam]
    system: str | list[TextPart] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # read only to refuse them by name


class MessagesRequest(MessagesCountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and not used (Anthropic's user_id)
    service_tier: str | None = None  # accepted and not used: one tier here
    # Anthropic's structured outputs (a JSON schema), and vLLM's `structured_outputs` extension
    # (json, regex, choice, grammar): either constrains the answer (server/structured.py).
    output_config: OutputConfig | None = None
    structured_outputs: dict[str, Any] | None = None
