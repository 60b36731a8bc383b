"""Engine outputs -> OpenAI's response and chunk shapes (chat and legacy completions),
including both logprobs formats, and the SSE framing of streams."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from fornax import __version__
from fornax.engine.async_engine import EngineDeadError, RequestFailedError
from fornax.engine.outputs import TokenLogprobs
from fornax.server.errors import error_body
from fornax.server.generation import Choice, Generation
from fornax.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ResponseMessage,
    StreamOptions,
    ToolCall,
    TopLogprob,
    Usage,
)
from fornax.tokenizer import Tokenizer
from fornax.tools import ToolCallDelta, tool_finish_reason
from fornax.tools.output import split_complete

if TYPE_CHECKING:
    from fornax.server.chat import ChatRun

logger = logging.getLogger("fornax.server")
SYSTEM_FINGERPRINT = f"fornax-{__version__}"


class TokenText:
    """Token id -> its text and raw bytes, as logprobs report them (cached per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.tokenizer.token_bytes(token_id)
            # A token may be part of a UTF-8 character: its text shows U+FFFD, its bytes are exact.
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def chat(self, entries: list[TokenLogprobs], k: int) -> list[ChatTokenLogprob]:
        out = []
        for e in entries:
            text, raw = self(e.token_id)
            top = []
            for tid, lp in list(zip(e.top_ids, e.top_logprobs))[:k]:
                t_text, t_raw = self(tid)
                top.append(TopLogprob(token=t_text, logprob=_finite(lp), bytes=t_raw))
            out.append(ChatTokenLogprob(token=text, logprob=_finite(e.logprob), bytes=raw, top_logprobs=top))
        return out

    def completion(self, entries: list[TokenLogprobs], k: int, choice: Choice) -> CompletionLogprobs:
        """Legacy format for sampled tokens; advances the choice's text offset."""
        result = CompletionLogprobs()
        for e in entries:
            text, _ = self(e.token_id)
            top = {self(tid)[0]: _finite(lp) for tid, lp in list(zip(e.top_ids, e.top_logprobs))[:k]}
            top.setdefault(text, _finite(e.logprob))
            _append(result, text, _finite(e.logprob), top, choice)
        return result

    def completion_prompt(
        self, prompt_ids: list[int], entries: list[TokenLogprobs] | None, k: int, choice: Choice
    ) -> CompletionLogprobs:
        """Echoed prompt tokens: the first has no logprob (nothing precedes it)."""
        result = CompletionLogprobs()
        for i, tid in enumerate(prompt_ids):
            text, _ = self(tid)
            e = entries[i - 1] if entries and 0 < i <= len(entries) else None
            if e is None:
                _append(result, text, None, None, choice)
                continue
            top = {self(t)[0]: _finite(lp) for t, lp in list(zip(e.top_ids, e.top_logprobs))[:k]}
            top.setdefault(text, _finite(e.logprob))
            _append(result, text, _finite(e.logprob), top, choice)
        return result

    def prompt_logprobs(
        self, prompt_ids: list[int], entries: list[TokenLogprobs] | None, k: int | None
    ) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: None for the first token, then each token's logprob and its
        top-k alternatives, keyed by token id (None when they were not asked for)."""
        if k is None or entries is None:
            return None
        out: PromptLogprobs = [None]
        for tid, e in zip(prompt_ids[1:], entries, strict=False):
            entry = {
                str(tid): PromptLogprob(logprob=_finite(e.logprob), rank=e.rank, decoded_token=self(tid)[0])
            }
            for rank, (alt, lp) in enumerate(list(zip(e.top_ids, e.top_logprobs))[:k], start=1):
                alt_lp = PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=self(alt)[0])
                entry.setdefault(str(alt), alt_lp)
            out.append(entry)
        return out


def _append(
    lp: CompletionLogprobs, text: str, logprob: float | None, top: dict[str, float] | None, choice: Choice
) -> None:
    lp.tokens.append(text)
    lp.token_logprobs.append(logprob)
    lp.top_logprobs.append(top)
    lp.text_offset.append(choice.text_offset)
    choice.text_offset += len(text)


def _finite(x: float) -> float:
    """JSON has no -inf: a token with zero probability reports a very small logprob."""
    return x if x > -9999.0 else -9999.0


def usage_of(gen: Generation) -> Usage:
    p, c = gen.num_prompt_tokens, gen.num_completion_tokens
    return Usage(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=p + c,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.num_cached_tokens),
    )


def _head(gen: Generation, model: str, created: int) -> dict[str, Any]:
    return {
        "id": gen.request_id,
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


# ---- non-streaming --------------------------------------------------------------------------------


async def collect(gen: Generation) -> Generation:
    async for _ in gen.outputs():
        pass
    return gen


def chat_completion(run: ChatRun, model: str, k: int | None) -> ChatCompletion:
    gen, text = run.gen, run.text
    choices = []
    for c in gen.choices:
        split = split_complete(run.splitter(), c.text)
        calls = [
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in split.calls
        ]
        # With tools, blank text beside the calls is no content (OpenAI sends null).
        content = split.content if run.tools.parser_name is None or split.content.strip() else None
        message = ResponseMessage(
            content=run.echo + (content or "") if run.echo else content,
            reasoning_content=split.reasoning,
            tool_calls=calls or None,
        )
        finish_reason = tool_finish_reason(bool(calls), c.finish_reason)
        logprobs = None if k is None else ChatLogprobs(content=text.chat(c.logprobs, k))
        choices.append(
            ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason)
        )
    prompt_lp = text.prompt_logprobs(
        gen.prompts[0], gen.choices[0].prompt_logprobs, gen.prompt_logprobs_shown
    )
    return ChatCompletion(
        **_head(gen, model, int(time.time())),
        choices=choices,
        usage=usage_of(gen),
        fornax=gen.timings(),
        prompt_logprobs=prompt_lp,
    )


def completion(
    gen: Generation, model: str, k: int | None, text: TokenText, echo_texts: list[str] | None
) -> Completion:
    choices = []
    for c in gen.choices:
        prefix = echo_texts[c.prompt_index] if echo_texts is not None else ""
        lp = None
        if k is not None:
            lp = CompletionLogprobs()
            if echo_texts is not None:
                _extend(lp, text.completion_prompt(gen.prompts[c.prompt_index], c.prompt_logprobs, k, c))
            _extend(lp, text.completion(c.logprobs, k, c))
        prompt_lp = text.prompt_logprobs(
            gen.prompts[c.prompt_index], c.prompt_logprobs, gen.prompt_logprobs_shown
        )
        choices.append(
            CompletionChoice(
                index=c.index,
                text=prefix + c.text,
                logprobs=lp,
                finish_reason=c.finish_reason,
                prompt_logprobs=prompt_lp,
            )
        )
    return Completion(
        **_head(gen, model, int(time.time())), choices=choices, usage=usage_of(gen), fornax=gen.timings()
    )


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


# ---- streaming ------------------------------------------------------------------------------------


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _delta_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall] | None:
    """Parser fragments -> OpenAI's delta.tool_calls: id, type and name on a call's first one."""
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ] or None


async def chat_stream(
    run: ChatRun, model: str, k: int | None, stream_options: StreamOptions | None
) -> AsyncIterator[str]:
    gen, text = run.gen, run.text
    head = _head(gen, model, int(time.time()))
    usage = UsageStream(gen, stream_options)
    # One splitter per choice: its text is read into reasoning, content and call fragments as it comes.
    splitters = {c.index: run.splitter() for c in gen.choices}
    prompt_lp_sent = gen.prompt_logprobs_shown is None
    try:
        for c in gen.choices:
            role = ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=run.echo))
            yield sse(ChatCompletionChunk(**head, choices=[role], usage=usage.now()))
        async for c, out in gen.outputs():
            lp = (
                None
                if k is None or not out.new_logprobs
                else ChatLogprobs(content=text.chat(out.new_logprobs, k))
            )
            splitter = splitters[c.index]
            piece = splitter.feed(out.new_text)
            if out.finished:
                piece += splitter.finish()
            calls = _delta_calls(piece.calls)
            prompt_lp = None
            if not prompt_lp_sent and c.prompt_logprobs is not None:
                prompt_lp_sent = True
                prompt_lp = text.prompt_logprobs(gen.prompts[0], c.prompt_logprobs, gen.prompt_logprobs_shown)
            if piece or lp is not None or prompt_lp is not None:
                plain = piece.content or not (calls or piece.reasoning)  # "" kept beside logprobs alone
                delta = DeltaMessage(
                    content=piece.content if plain else None,
                    reasoning_content=piece.reasoning or None,
                    tool_calls=calls,
                )
                choice = ChatChunkChoice(index=c.index, delta=delta, logprobs=lp)
                yield sse(
                    ChatCompletionChunk(
                        **head, choices=[choice], usage=usage.now(), prompt_logprobs=prompt_lp
                    )
                )
            if out.finished:
                reason = tool_finish_reason(splitter.called, c.finish_reason)
                end = ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason)
                yield sse(
                    ChatCompletionChunk(**head, choices=[end], fornax=c.fornax_timings(), usage=usage.now())
                )
        if usage.at_end:
            yield sse(ChatCompletionChunk(**head, choices=[], usage=usage_of(gen)))
    except Exception as exc:
        yield sse(stream_error(exc))
    yield SSE_DONE


class UsageStream:
    """Which stream chunks carry usage: the final one (`include_usage`), and with vLLM's
    `continuous_usage_stats` every one, counting the tokens so far."""

    def __init__(self, gen: Generation, options: StreamOptions | None) -> None:
        self.gen = gen
        self.at_end = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)

    def now(self) -> Usage | None:
        return usage_of(self.gen) if self.continuous else None


async def completion_stream(
    gen: Generation,
    model: str,
    k: int | None,
    text: TokenText,
    echo_texts: list[str] | None,
    stream_options: StreamOptions | None,
) -> AsyncIterator[str]:
    head = _head(gen, model, int(time.time()))
    usage = UsageStream(gen, stream_options)
    try:
        started: set[int] = set()
        async for c, out in gen.outputs():
            if c.index not in started and (echo_texts is not None or gen.prompt_logprobs_shown is not None):
                # The prompt's logprobs come with a choice's first output: echo it, and them, then.
                started.add(c.index)
                prompt_ids = gen.prompts[c.prompt_index]
                echo = echo_texts[c.prompt_index] if echo_texts is not None else ""
                lp = (
                    None
                    if k is None or echo_texts is None
                    else text.completion_prompt(prompt_ids, c.prompt_logprobs, k, c)
                )
                prompt_lp = text.prompt_logprobs(prompt_ids, c.prompt_logprobs, gen.prompt_logprobs_shown)
                first = CompletionChoice(index=c.index, text=echo, logprobs=lp, prompt_logprobs=prompt_lp)
                yield sse(Completion(**head, choices=[first], usage=usage.now()))
            lp = None if k is None or not out.new_logprobs else text.completion(out.new_logprobs, k, c)
            if out.new_text or lp is not None:
                choice = CompletionChoice(index=c.index, text=out.new_text, logprobs=lp)
                yield sse(Completion(**head, choices=[choice], usage=usage.now()))
            if out.finished:
                end = CompletionChoice(index=c.index, text="", finish_reason=c.finish_reason)
                yield sse(Completion(**head, choices=[end], fornax=c.fornax_timings(), usage=usage.now()))
        if usage.at_end:
            yield sse(Completion(**head, choices=[], usage=usage_of(gen)))
    except Exception as exc:
        yield sse(stream_error(exc))
    yield SSE_DONE


def stream_error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, ValueError):
        return error_body(str(exc), "invalid_request_error")
    if isinstance(exc, RequestFailedError):  # the engine logged it; this request alone ended
        return error_body(
            "internal error while generating this request; it was ended",
            "server_error",
            code="internal_error",
        )
    if isinstance(exc, EngineDeadError):
        return error_body(f"the engine has stopped: {exc}", "service_unavailable", code="engine_dead")
    logger.exception("error while streaming")
    return error_body("internal server error", "server_error", code="internal_error")
