"""The typed objects handed from one stage of a step to the next (docs/architecture.md, rule 3):

    Request -> SchedulerOutput -> ModelRunnerOutput -> (EngineCore) -> RequestOutput

No torch here either: the runner converts to and from tensors at its own edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fornax.engine.kv.offload.connector import TransferPlan
from fornax.engine.request import Request

if TYPE_CHECKING:
    from fornax.models.lora import LoRAAdapter


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    # Draft tokens verified this step: they follow the request's known tokens, so the step
    # computes positions [start, num_tokens + len(spec_token_ids)) and samples at the last
    # 1 + len(spec_token_ids) of them.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        """Position of the first token computed this step (== num_computed_tokens before the step)."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    """What to run this step. Token layout in the batch follows `scheduled` order."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests finished or aborted since the last step: the runner drops their state.
    # Preempted requests are listed apart and keep theirs (their RNG state goes on).
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # KV tier copies to carry out before the forward pass (engine/kv/offload); None: none.
    kv_transfers: TransferPlan | None = None
    # LoRA adapters to write into slots before the forward pass (engine/lora/).
    lora_writes: list[tuple[int, LoRAAdapter]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (ids and values, best first)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the chosen token in the distribution
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """Per scheduled request that sampled: the new token (and its logprobs if asked); per
    pooling request that finished its prompt: its vector."""

    sampled: dict[str, int]  # request_id -> sampled token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request_id -> logprobs of prompt tokens computed this step (positions start+1 .. ),
    # one entry per prompt token after the first.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that verified drafts: their new tokens (the accepted drafts, then the target's
    # own token) in place of an entry in `sampled`, and logprobs for each of them.
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Pooling requests whose prompt ended this step: request_id -> the pooled vector
    # (engine/runner/pooler.py), float32 values as Python floats.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineOutput:
    """What one step produced for one sequence (a child of a request when n > 1)."""

    request_id: str  # the user's request id (parent)
    index: int  # which of the n samples
    new_token_ids: list[int]
    new_text: str  # text delta, UTF-8 safe, stop strings held back until resolved
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # sent once, with the first output
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timings: dict[str, float] | None = None  # set when finished: queue, ttft, prefill, decode, e2e (s)
    # Set when the engine failed this request on an internal error (it is finished, its KV
    # freed): the message for the log. The caller answers 500; other requests go on.
    error: str | None = None
    # The failure was the request's own (a structured-output constraint no token can meet): the
    # caller answers it as a bad request (400), not as an internal error.
    invalid_request: bool = False
    # A pooling request's vector, on its one (final) output; None for generation.
    embedding: list[float] | None = None
