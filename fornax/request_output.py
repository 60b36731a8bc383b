"""What the offline API returns: vLLM's RequestOutput / CompletionOutput shapes,
EmbeddingRequestOutput for LLM.embed and ScoringRequestOutput for LLM.score."""

from __future__ import annotations

from dataclasses import dataclass, field

from fornax.engine.outputs import TokenLogprobs
from fornax.tools import ToolCall


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # the engine ended this sequence on an internal error (logged)
    # LLM.chat with tools: the calls read from `text`, and the text that is not a call (None
    # when there is none), as OpenAI's message.tool_calls and message.content.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Seconds: queue (arrival -> first scheduled), ttft (arrival -> first token),
    # prefill (first scheduled -> first token), decode (first -> last token), e2e.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding (LLM.embed): the pooled vector and what it was computed from."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float] = field(default_factory=list)
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ScoringRequestOutput:
    """One text pair's score (LLM.score): a cosine similarity of embeddings, or a cross-encoder's
    score (engine/scoring.py). vLLM nests the score (`outputs.score`); here it is flat."""

    text_1: str
    text_2: str
    score: float
    num_prompt_tokens: int  # the two texts' (embeddings) or the pair sequence's (cross-encoder)
