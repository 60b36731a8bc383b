"""Server-side bounds on one request, and the mapping of request fields onto SamplingParams.

Everything here runs before a request reaches the engine, so a bad request costs a 400 and
no KV blocks. The numbers come from ServerConfig (flags of `fornax serve`); the engine keeps
its own, looser, hard floor in engine/request.py.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from fornax.config import PRIORITY_RANGE, ServerConfig
from fornax.engine.request import SamplingParams, SamplingParamsError
from fornax.engine.structured.spec import GUIDED_FIELDS, StructuredOutputsParams
from fornax.server.errors import ApiError, bad_request, validation_error
from fornax.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    _SamplingFields,
)

M = TypeVar("M", bound=BaseModel)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

if TYPE_CHECKING:  # not at run time: body_parser.py's worker process imports this module
    from fastapi import Request


# ---- the body -----------------------------------------------------------------------------------


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, bounded by Content-Length and by the bytes actually read (so a chunked
    body without a length is bounded too). body_parser.parse_body decodes it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nesting too deep") from None
    except ValueError as exc:  # a syntax error, or a number refused by the two hooks below
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range for a 64-bit float")
    return value


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")


def parse_model(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise bad_request("the request is nested too deeply") from None


# ---- messages and prompts -----------------------------------------------------------------------


def check_messages(messages: list[ChatMessage], config: ServerConfig) -> list[dict[str, Any]]:
    """Chat messages -> the plain dicts a chat template expects (text content only)."""
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    if len(messages) > config.max_messages:
        raise bad_request(f"at most {config.max_messages} messages are allowed", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"unknown role {m.role!r} in messages[{i}]", param=f"messages.{i}.role")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}]: only text content parts are supported", param=f"messages.{i}.content"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        out.append(entry)
    return out


def check_prompts(prompt: Any, config: ServerConfig, param: str = "prompt") -> list[str | list[int]]:
    """A completions `prompt` (string, strings, token ids, lists of token ids) -> a list of prompts
    (`param`: the field's name, "input" on /v1/embeddings)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    # The model validated `prompt` as one of str | list[str] | list[int] | list[list[int]], so
    # the first item tells which list; checking all of them ran on the event loop and took
    # 20-50 ms for 600k token ids (2026-12-04).
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request(f"'{param}' must not be empty", param=param)
    if len(prompts) > config.max_prompts:
        raise bad_request(
            f"at most {config.max_prompts} prompts are allowed in one request (--max-prompts)", param=param
        )
    for p in prompts:
        if isinstance(p, list) and not p:
            raise bad_request("a token-id prompt must not be empty", param=param)
    return prompts


# Text past this many characters per token of context cannot fit whatever it encodes to
# (BPE tokens of real text average 3-5 characters; 32 leaves room for runs of spaces), so it
# is refused before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 32


def check_text_fits(texts: list[str], max_model_len: int, param: str) -> None:
    """400 for text too long to fit the context in any encoding, before tokenizing it."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(t) for t in texts) > limit:
        raise bad_request(
            f"the text is longer than {limit} characters: more than this model's context of "
            f"{max_model_len} tokens could hold",
            param=param,
            code="context_length_exceeded",
        )


def check_token_count(ids: list[int], max_model_len: int, param: str) -> None:
    if len(ids) > max_model_len:
        raise bad_request(
            f"{len(ids)} tokens are more than this model's context of {max_model_len}",
            param=param,
            code="context_length_exceeded",
        )


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if isinstance(m.get("content"), str)]


def check_tokenize_input(
    req: TokenizeRequest, config: ServerConfig, max_model_len: int
) -> tuple[list[dict[str, Any]] | None, str]:
    """What /tokenize and /v1/fornax/tokens check before tokenizing: exactly one of prompt and
    messages, the messages' shape, and text that could fit the context. Returns (the messages
    as template dicts, or None for a prompt; the param name errors should carry)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.messages is None:
        assert req.prompt is not None
        check_text_fits([req.prompt], max_model_len, "prompt")
        return None, "prompt"
    messages = check_messages(req.messages, config)
    check_text_fits(message_texts(messages), max_model_len, "messages")
    return messages, "messages"


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    # min and max scan in C: for 600k ids, ~20 ms in two holds of the GIL, where a Python loop
    # took ~35 ms of turns with the event loop (2026-12-04); the loop only finds the culprit.
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is out of range for a vocabulary of {vocab_size}", param=param)


# ---- sampling ------------------------------------------------------------------------------------


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, config: ServerConfig, param: str
) -> int:
    """The output budget: the request's, or (absent) whatever the context leaves, clamped by the server."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion.",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        budget = room
    else:
        if requested < 1:
            raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                f"for the completion, '{param}'). Please reduce the prompt or the completion length.",
                param=param,
                code="context_length_exceeded",
            )
        budget = requested
    if config.max_tokens_limit is not None:
        budget = min(budget, config.max_tokens_limit)
    return budget


def check_sampling_fields(req: _SamplingFields, config: ServerConfig, vocab_size: int) -> None:
    """The bounds that do not depend on the prompt."""
    if not 1 <= req.n <= config.max_n:
        raise bad_request(f"'n' must be in [1, {config.max_n}], got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop sequences are allowed", param="stop")
    for s in stops:
        if not s or len(s) > config.max_stop_string_chars:
            raise bad_request(
                f"stop sequences must be 1 to {config.max_stop_string_chars} characters", param="stop"
            )
    if len(req.stop_token_ids or []) > config.max_stop_strings * 4:
        raise bad_request("too many stop_token_ids", param="stop_token_ids")
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    if req.logit_bias and len(req.logit_bias) > config.max_logit_bias:
        raise bad_request(f"logit_bias may have at most {config.max_logit_bias} entries", param="logit_bias")
    low, high = PRIORITY_RANGE
    if not low <= req.priority <= high:
        raise bad_request(
            f"'priority' must be in [{low}, {high}] (lower runs earlier), got {req.priority}",
            param="priority",
        )
    if req.top_k is not None and not req.top_k >= -1:
        raise bad_request(f"'top_k' must be -1, 0 or positive, got {req.top_k}", param="top_k")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is out of range", param="logit_bias")
        out[token_id] = value
    return out


def num_logprobs(req: ChatCompletionRequest | CompletionRequest, config: ServerConfig) -> int | None:
    """How many top alternatives per token (None: no logprobs at all)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'logprobs' must be true when 'top_logprobs' is set", param="top_logprobs")
        k, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        k, param = req.logprobs, "logprobs"
    if k is not None and not 0 <= k <= config.max_top_logprobs:
        raise bad_request(f"'{param}' must be in [0, {config.max_top_logprobs}], got {k}", param=param)
    p = req.prompt_logprobs
    if p is not None and not 0 <= p <= config.max_top_logprobs:
        raise bad_request(
            f"'prompt_logprobs' must be in [0, {config.max_top_logprobs}], got {p}", param="prompt_logprobs"
        )
    return k


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    echo_logprobs = isinstance(req, CompletionRequest) and req.echo and logprobs is not None
    prompt_logprobs = max(
        req.prompt_logprobs if req.prompt_logprobs is not None else -1,
        logprobs if echo_logprobs and logprobs is not None else -1,
    )
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k >= vocab_size else req.top_k,  # >= vocab: no-op
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=parse_logit_bias(req.logit_bias, vocab_size),
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs >= 0 else None,
            num_speculative_tokens=req.num_speculative_tokens,
            structured_outputs=structured_outputs,
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


# ---- fields that are not implemented --------------------------------------------------------------

# Fields that change what an answer means: ignoring them (as unknown fields are) would return
# free text where the caller asked for a function call or the best of several samples. Each
# maps to the values that ask for nothing beyond plain generation.
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # OpenAI's deprecated form of `tools`
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
}
# vLLM's older structured-output fields: guided_json/regex/choice/grammar are served
# (server/structured.py); the others would change decoding in ways fornax does not implement.
_GUIDED_SERVED = frozenset(GUIDED_FIELDS)
_GUIDED_HARMLESS = frozenset({"guided_decoding_backend"})  # fornax has one grammar engine


def reject_unimplemented(body: dict[str, Any]) -> None:
    """400 naming the first field whose value asks for something fornax cannot do yet."""
    for name, harmless in _UNIMPLEMENTED.items():
        if name in body and body[name] not in harmless:
            raise bad_request(
                f"'{name}' is not supported by this server; the request was not run",
                param=name,
                code="unsupported_parameter",
            )
    for name, value in body.items():
        if name.startswith("guided_") and value is not None and name not in _GUIDED_SERVED | _GUIDED_HARMLESS:
            raise bad_request(
                f"'{name}' is not supported by this server; use structured_outputs",
                param=name,
                code="unsupported_parameter",
            )
    best_of, n = body.get("best_of"), body.get("n", 1)
    if best_of is not None and best_of != n and best_of != 1:
        raise bad_request(
            "'best_of' other than n is not supported: every sample is returned (use n)",
            param="best_of",
            code="unsupported_parameter",
        )
