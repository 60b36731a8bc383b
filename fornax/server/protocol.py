"""Pydantic models of the OpenAI request, response and stream-chunk shapes (plus fornax's
/tokenize, /detokenize and the `fornax` timing extension).

Requests ignore unknown fields, as OpenAI does, and reject wrong types (a 400, via
errors.validation_error). NaN and infinities are refused everywhere. Responses keep
OpenAI's nulls (`"logprobs": null`, `"finish_reason": null`); fields listed in
`_omit_if_none` are left out instead when empty (fornax's extension, a delta's role).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()
    _key_order: ClassVar[tuple[str, ...]] = ()  # keys that come first, in this order

    @model_serializer(mode="wrap")
    def _shape(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self._omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        if self._key_order:
            first = {k: data.pop(k) for k in self._key_order if k in data}
            data = first | data
        return data


# ---- requests -----------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class ContentPart(_Request):
    type: str
    text: str | None = None


class ToolCallFunctionIn(_Request):
    name: str = Field(max_length=64)
    arguments: str = Field(default="{}", max_length=1 << 20)  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    """A call the assistant made in an earlier turn (sent back with the conversation)."""

    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)


class JsonSchemaFormat(_Request):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` is a BaseModel attribute; the alias keeps OpenAI's key on the wire.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """What chat and completions requests share, in OpenAI's (and vLLM's) names."""

    model: str | None = None
    max_tokens: int | None = None  # absent: up to the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    # vLLM's: top-k logprobs of every prompt token (the first has none), in its format.
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None  # fornax: per-request draft tokens (0: no speculation)
    # vLLM's: requests share cached prompt blocks only with requests of the same salt (and, with
    # --prefix-cache-scope key, of the same API key). Bounded: it is hashed once per request.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Constrained output (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs (json, regex, choice, grammar, json_object) and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI tools (fornax/tools): checked by tools.check_tools, so kept as plain JSON here.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # The template: extra variables (`enable_thinking`...), whether it adds the assistant turn's
    # opening, or continues the last (assistant) message instead; vLLM's fields.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the continued final assistant message starts the content
    # Reasoning models: OpenAI's effort maps to the template's thinking switch ("none": off);
    # include_reasoning false drops the thinking from the reply (vLLM's).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    # Not a completions feature: read only to refuse them by name (api.completions).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(_Response):
    _omit_if_none = frozenset({"tool_calls", "reasoning_content"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (vLLM's and DeepSeek's name)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class PromptLogprob(_Response):
    logprob: float
    rank: int | None = None
    decoded_token: str


class _Envelope(_Response):
    _omit_if_none = frozenset({"fornax", "usage"})
    _key_order = ("id", "object", "created", "model", "system_fingerprint", "choices", "usage")
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    fornax: dict[str, Any] | None = None  # timings extension


# vLLM's prompt_logprobs: per prompt token, {token id: logprob} of it and its top alternatives;
# None for the first token, which nothing precedes.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletion(_Envelope):
    _omit_if_none = _Envelope._omit_if_none | {"prompt_logprobs"}
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(_Response):
    _omit_if_none = frozenset({"name"})
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(_Response):
    """One streamed fragment of a call: id, type and name come once, on its first fragment."""

    _omit_if_none = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    _omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Envelope):
    _omit_if_none = _Envelope._omit_if_none | {"prompt_logprobs"}
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on the first chunk that carries output


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_if_none = frozenset({"prompt_logprobs"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fornax"
    max_model_len: int | None = None
    # fornax: whether the model's engine runs in deterministic mode (docs/deterministic.md)
    deterministic: bool | None = None
    # fornax: the kernels the model runs on, e.g. "kernels: avx2+fma; decode int4, large steps
    # int8 x int8, attention bf16" (docs/kernels.md); None while the model is not loaded
    kernels: str | None = None
    # fornax: the API routes the model serves ("chat", ..., "embeddings"); None while not loaded
    endpoints: list[str] | None = None
    # A LoRA adapter's card (vLLM's fields): the model it adapts, and where it was loaded from.
    parent: str | None = None
    root: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
