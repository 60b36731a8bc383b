"""What the metrics read of one finished request, declared here so that the metrics depend on
no server type: the server's RequestRecord (server/state.py) has these fields, and any other
producer (a test, a batch runner) can hand in its own object with them."""

from __future__ import annotations

from typing import Protocol


class FinishedRequest(Protocol):
    """One finished (or aborted) generation request; `timings` holds the engine's per-request
    seconds (queue_s, ttft_s, prefill_s, decode_s, e2e_s, and spec_* when it speculated)."""

    @property
    def endpoint(self) -> str: ...  # the API route: "chat", "completions", "messages", ..., "embeddings"

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_completion_tokens(self) -> int: ...

    @property
    def finish_reasons(self) -> list[str | None]: ...

    @property
    def timings(self) -> dict[str, float]: ...

    @property
    def aborted(self) -> bool: ...

    @property
    def lora(self) -> str | None: ...  # the LoRA adapter it ran with (None: the base model)
