"""One HTTP request's engine work: one engine request per prompt, `n` choices each.

`Generation.outputs()` yields (choice, EngineOutput) as the engine produces them and keeps
each choice's running state (text, tokens, logprobs, finish reason, timings). Leaving it
early, for any reason, aborts whatever is unfinished: that is how a client disconnect
frees its KV blocks within one engine step. When it ends it hands one RequestRecord to
the server state (usage per key, abort counter, access log, metrics listeners).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from fornax.engine.async_engine import AsyncEngine
from fornax.engine.outputs import EngineOutput, TokenLogprobs
from fornax.engine.pooling import PoolingParams
from fornax.engine.request import SamplingParams
from fornax.server.state import Inflight, RequestRecord, ServerState

T = TypeVar("T")


@dataclass
class Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    timings: dict[str, float] | None = None
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    embedding: list[float] | None = None  # a pooling request's vector (server/embeddings.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.timings = out.timings

    def fornax_timings(self) -> dict[str, float]:
        """The `fornax` extension object for this choice: engine timings plus throughput."""
        return _with_rates(dict(self.timings or {}), len(self.token_ids))


def _with_rates(t: dict[str, float], num_tokens: int) -> dict[str, float]:
    e2e, decode = t.get("e2e_s", 0.0), t.get("decode_s", 0.0)
    t["tokens_per_s"] = num_tokens / e2e if e2e > 0 else 0.0
    t["decode_tokens_per_s"] = (num_tokens - 1) / decode if decode > 0 and num_tokens > 1 else 0.0
    t.pop("num_preemptions", None)
    return t


class Generation:
    def __init__(
        self,
        state: ServerState,
        request_id: str,
        endpoint: str,
        key_name: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        stream: bool,
        engine: AsyncEngine,
        model_name: str,
        cache_salt: str | None = None,
        pooling: PoolingParams | list[PoolingParams] | None = None,
        lora: str | None = None,
    ) -> None:
        self.state, self.engine, self.model_name = state, engine, model_name
        self.request_id, self.endpoint, self.key_name, self.stream = request_id, endpoint, key_name, stream
        self.prompts, self.params, self.priority = prompts, params, priority
        self.choices = [Choice(p * params.n + i, p) for p in range(len(prompts)) for i in range(params.n)]
        self.engine_ids = (
            [request_id] if len(prompts) == 1 else [f"{request_id}-{p}" for p in range(len(prompts))]
        )
        self.cache_salt = cache_salt  # the engine's prefix-cache salt (tenancy.Tenancy.cache_salt)
        self.lora = lora  # the LoRA adapter it runs with (by name; None: the base model)
        # Pooling requests (embeddings) go to the engine with these (one for all prompts, or one
        # per prompt: a cross-encoder's pairs each carry their token types); `params` then only
        # counts them for admission and limits (one sequence of at most one token each).
        self.pooling = pooling
        # The request's own `prompt_logprobs` (vLLM's field), shown in vLLM's format; the engine
        # may compute prompt logprobs for completions' echo alone, which shows them its own way.
        self.prompt_logprobs_shown: int | None = None
        # Owners are known before the engine hears of the requests, so even their `queued`
        # event is shown to their key only.
        state.tenancy.claim([request_id, *self.engine_ids], key_name)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        # Siblings share the prompt's blocks; count each prompt once (by its first choice).
        return sum(self.choices[p * self.params.n].num_cached_tokens for p in range(len(self.prompts)))

    async def outputs(self) -> AsyncIterator[tuple[Choice, EngineOutput]]:
        entry = self.state.inflight[self.request_id] = Inflight(
            self.engine_ids, self.engine, len(self.choices)
        )
        try:
            async for prompt_index, out in self._merged():
                entry.started = True
                choice = self.choices[prompt_index * self.params.n + out.index]
                choice.update(out)
                yield choice, out
        finally:
            self.state.inflight.pop(self.request_id, None)
            unfinished = not all(c.finished for c in self.choices)
            if unfinished:
                for engine_id in self.engine_ids:
                    self.engine.abort(engine_id)
            aborted = unfinished or any(c.finish_reason == "abort" for c in self.choices)
            self.state.finish(self._record(aborted))

    def _engine_params(self, p: int) -> SamplingParams | PoolingParams:
        """What prompt p's engine request runs with."""
        if isinstance(self.pooling, list):
            return self.pooling[p]
        return self.pooling or self.params

    async def _merged(self) -> AsyncIterator[tuple[int, EngineOutput]]:
        """All prompts' outputs in arrival order, tagged with the prompt's index."""
        if len(self.prompts) == 1:
            gen = self.engine.generate(
                self.engine_ids[0],
                self.prompts[0],
                self._engine_params(0),
                self.priority,
                cache_salt=self.cache_salt,
                lora=self.lora,
            )
            async with contextlib.aclosing(gen):
                async for out in gen:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue()

        async def pump(p: int) -> None:
            try:
                gen = self.engine.generate(
                    self.engine_ids[p],
                    self.prompts[p],
                    self._engine_params(p),
                    self.priority,
                    cache_salt=self.cache_salt,
                    lora=self.lora,
                )
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        queue.put_nowait((p, out))
                queue.put_nowait((p, None))
            except Exception as exc:
                queue.put_nowait((p, exc))

        tasks = [asyncio.create_task(pump(p)) for p in range(len(self.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                p, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            for task in tasks:
                task.cancel()

    def timings(self) -> dict[str, float]:
        """Request-level timings: the earliest choice's queue/TTFT, the last one's end."""
        ts = [c.timings for c in self.choices if c.timings]
        if not ts:
            return {}
        first = min(ts, key=lambda t: t.get("ttft_s", 0.0))
        merged = {
            "queue_s": min(t.get("queue_s", 0.0) for t in ts),
            "ttft_s": first.get("ttft_s", 0.0),
            "prefill_s": first.get("prefill_s", 0.0),
            "decode_s": max(t.get("decode_s", 0.0) for t in ts),
            "e2e_s": max(t.get("e2e_s", 0.0) for t in ts),
        }
        merged |= _merge_spec(ts)
        return _with_rates(merged, self.num_completion_tokens)

    def _record(self, aborted: bool) -> RequestRecord:
        return RequestRecord(
            request_id=self.request_id,
            endpoint=self.endpoint,
            model=self.model_name,
            key_name=self.key_name,
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=self.num_completion_tokens,
            num_cached_tokens=self.num_cached_tokens,
            finish_reasons=[c.finish_reason for c in self.choices],
            timings=self.timings(),
            stream=self.stream,
            aborted=aborted,
            lora=self.lora,
        )


class ClientGone(Exception):
    """The client closed the connection before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves.

    The body has been read already, so the next ASGI message can only be the disconnect:
    this waits on it instead of polling.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message: dict[str, Any] = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _merge_spec(ts: list[dict[str, float]]) -> dict[str, float]:
    """Speculative decoding figures over all choices: sums, then rates of the sums."""
    steps = sum(t.get("spec_num_steps", 0.0) for t in ts)
    if not steps:
        return {}
    drafts = sum(t.get("spec_num_draft_tokens", 0.0) for t in ts)
    accepted = sum(t.get("spec_num_accepted_tokens", 0.0) for t in ts)
    return {
        "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
        "spec_mean_accepted_len": 1.0 + accepted / steps,
        "spec_num_draft_tokens": drafts,
        "spec_num_accepted_tokens": accepted,
        "spec_num_steps": steps,
    }
