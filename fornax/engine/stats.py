"""What observers may read of a running engine: EngineCore.stats() and EngineCore.sequences().

The server, the metrics, the visualizer and the event tap read the engine through these
frozen records, never through the scheduler, the KV manager or the per-sequence tables
(docs/architecture.md, "Layering"), so the engine can change how it keeps its state without
changing what they see. Both are built on demand, between steps (the engine thread, or a
function run there through AsyncEngine.call), so their numbers agree with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from fornax.engine.request import RequestStatus


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's queues, KV cache and lifetime counters, as of the end of its last step."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting for (re)admission, preempted ones included
    num_preemptions_total: int  # sequences preempted to free KV blocks, over the engine's life
    # The primary KV cache: blocks of block_size tokens; usage is the fraction some sequence holds
    # (cached blocks no sequence holds count as free).
    block_size: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    # Prefix cache, in prompt tokens, counted once per request when its blocks are allocated.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding: draft tokens verified and accepted, over the engine's life.
    spec_num_draft_tokens_total: int
    spec_num_accepted_tokens_total: int
    # The last step: tokens computed and sequences scheduled (0, 0 before the first step).
    last_step_num_batched_tokens: int
    last_step_num_seqs: int

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One unfinished sequence (a child of its request when n > 1), as observers see it."""

    request_id: str  # the user's request id (the parent, when n > 1)
    index: int  # which of the request's n samples
    status: RequestStatus  # WAITING, RUNNING or PREEMPTED
    num_prompt_tokens: int
    num_computed_tokens: int
    num_tokens: int  # prompt and output tokens so far
    num_blocks: int  # KV blocks it holds in the primary cache

    @property
    def running(self) -> bool:
        return self.status == RequestStatus.RUNNING
