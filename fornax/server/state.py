"""What the server knows between requests: its models and their engines (server/model_set.py),
lifecycle flags, the requests in flight, counters and per-key usage.

One `ServerState` lives at `app.state.fornax`. It is also what the metrics read (metrics/):
`record_listeners` receive one `RequestRecord` per finished request, and the counters here
(`num_aborted`, `num_rejected`, ...) are plain ints a collector can read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fornax.config import EngineConfig, ServerConfig
from fornax.server.model_set import ModelSet
from fornax.server.response_store import ResponseStore
from fornax.server.tenancy import Tenancy

if TYPE_CHECKING:
    from fornax.engine.async_engine import AsyncEngine

access_logger = logging.getLogger("fornax.access")


@dataclass
class RequestRecord:
    """One finished (or aborted) generation request, as the access log, usage accounting and
    the metrics see it (the last through the fields they declare: metrics/records.py)."""

    request_id: str
    endpoint: str  # "chat" | "completions" | "messages" (Anthropic's Messages API) | "responses" (OpenAI's)
    model: str  # the served model's (first) name: whose metrics count it
    key_name: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    finish_reasons: list[str | None]
    timings: dict[str, float]  # queue_s, ttft_s, prefill_s, decode_s, e2e_s, tokens_per_s
    stream: bool
    aborted: bool  # the client went away, or the server gave up on it while draining
    lora: str | None = None  # the LoRA adapter it ran with (None: the base model)

    def log_line(self) -> str:
        t = self.timings
        reasons = ",".join(r or "none" for r in self.finish_reasons)
        return (
            f"{self.request_id} key={self.key_name} {self.endpoint}{' stream' if self.stream else ''}"
            f"{f' lora={self.lora}' if self.lora else ''} "
            f"prompt={self.num_prompt_tokens} completion={self.num_completion_tokens} "
            f"cached={self.num_cached_tokens} queue={t.get('queue_s', 0.0):.3f}s ttft={t.get('ttft_s', 0.0):.3f}s "
            f"total={t.get('e2e_s', 0.0):.3f}s finish={reasons}"
        )


@dataclass
class KeyUsage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Inflight:
    """A request between admission and its last output."""

    engine_ids: list[str]  # one engine request per prompt
    engine: AsyncEngine  # the model's engine that runs them
    num_seqs: int = 1  # prompts x n: what admission counts
    started: bool = False  # has produced output (no longer queued)


@dataclass
class ServerState:
    config: ServerConfig
    models: ModelSet
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    inflight: dict[str, Inflight] = field(default_factory=dict)  # by the response's id
    num_aborted: int = 0
    num_rejected_queue_full: int = 0
    usage: dict[str, KeyUsage] = field(default_factory=dict)
    record_listeners: list[Callable[[RequestRecord], None]] = field(default_factory=list)
    tenancy: Tenancy = field(init=False)  # owners of requests, cache salts, rate limits
    responses: ResponseStore = field(init=False)  # kept Responses API responses, by key

    def __post_init__(self) -> None:
        self.tenancy = Tenancy(self.config)
        self.responses = ResponseStore(self.config.max_stored_responses)

    @property
    def engine(self) -> AsyncEngine | None:
        """The first model's engine (the only one, on a single-model server)."""
        return self.models.primary.engine

    @property
    def engine_config(self) -> EngineConfig:
        return self.models.primary.config.engine

    @property
    def load_error(self) -> str | None:
        """Why a model loaded at start-up failed to (lazily loaded ones fail their requests)."""
        if self.models.lazy:
            return None
        return next((m.load_error for m in self.models.models if m.load_error is not None), None)

    @property
    def engine_error(self) -> str | None:
        """Why an engine died (its loop failed), or None while they run or load."""
        for model in self.models.loaded():
            exc = model.engine.dead_error if model.engine is not None else None
            if exc is not None:
                return f"{type(exc).__name__}: {exc}"
        return None

    @property
    def ready(self) -> bool:
        """Serving: every model is loaded (or, with lazy loading, can be), none has died, and
        the server is not draining."""
        if self.draining or self.engine_error is not None:
            return False
        return self.models.lazy or all(m.engine is not None for m in self.models.models)

    @property
    def model_name(self) -> str:
        return self.models.primary.name

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet producing tokens (waiting for, or in, prefill)."""
        return sum(1 for entry in self.inflight.values() if not entry.started)

    @property
    def num_queued_sequences(self) -> int:
        return sum(entry.num_seqs for entry in self.inflight.values() if not entry.started)

    def finish(self, record: RequestRecord) -> None:
        """Account one finished request: usage per key, abort count, log line, listeners."""
        usage = self.usage.setdefault(record.key_name, KeyUsage())
        usage.requests += 1
        usage.prompt_tokens += record.num_prompt_tokens
        usage.completion_tokens += record.num_completion_tokens
        # The rate limiter reserved the worst case at admission: now it counts what was used.
        self.tenancy.settle(record.request_id, record.num_prompt_tokens + record.num_completion_tokens)
        if record.aborted:
            self.num_aborted += 1
        if self.config.access_log:
            access_logger.info(record.log_line())
        model = self.models.by_name.get(record.model)
        if model is not None:
            model.metrics.on_record(record)
            model.live.on_record(record)
        for listener in self.record_listeners:
            try:
                listener(record)
            except Exception:
                logging.getLogger("fornax.server").exception("request listener failed")
