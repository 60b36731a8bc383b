"""Admission: whether the server takes a generation request now, counted in work, not HTTP
requests.

One request may carry 64 prompts with n=16: that is 1,024 sequences for the scheduler and
up to 1,024 x max_tokens tokens of decoding. So a request is checked against the queued
requests, the queued sequences and a per-request token budget; a full queue answers 429
with Retry-After (retrying later helps), and so does a request larger than the budget, as
OpenAI answers a request over a tokens-per-minute limit. Negative priorities (ahead of
everyone's default 0) are for privileged keys only.
"""

from __future__ import annotations

from fornax.engine.request import SamplingParams
from fornax.server.errors import ApiError
from fornax.server.state import ServerState
from fornax.server.tenancy import ADMIN


def request_cost(prompts: list[list[int]], params: SamplingParams) -> int:
    """Tokens a request may compute: each prompt once (its n samples share its blocks), plus
    n completions of max_tokens each."""
    max_tokens = params.max_tokens or 0
    return sum(len(p) + params.n * max_tokens for p in prompts)


def admit(
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    key_name: str,
    role: str | None,
) -> None:
    """Raise the ApiError that refuses this request, or return to take it."""
    config = state.config
    if priority < 0 and not _privileged(state, key_name, role):
        raise ApiError(
            403,
            "negative priorities are reserved for privileged keys",
            param="priority",
            code="priority_not_allowed",
        )
    cost = request_cost(prompts, params)
    if cost > config.max_request_tokens:
        raise _too_much(
            state,
            f"this request may compute {cost} tokens (prompts plus n x max_tokens), over "
            f"the per-request budget of {config.max_request_tokens}",
            "request_too_large",
        )
    num_seqs = len(prompts) * params.n
    if state.num_queued >= config.max_queued_requests:
        raise _too_much(state, "too many requests are waiting; retry later", "queue_full")
    if state.num_queued_sequences + num_seqs > config.max_queued_sequences:
        raise _too_much(
            state,
            f"too many sequences are waiting ({state.num_queued_sequences} queued, this "
            f"request adds {num_seqs}, limit {config.max_queued_sequences}); retry later",
            "queue_full",
        )


def _privileged(state: ServerState, key_name: str, role: str | None) -> bool:
    config = state.config
    open_server = not config.api_keys and not config.admin_keys
    return open_server or role == ADMIN or key_name in config.privileged_keys


def _too_much(state: ServerState, message: str, code: str) -> ApiError:
    state.num_rejected_queue_full += 1
    return ApiError(429, message, code=code, headers={"Retry-After": str(state.config.retry_after_s)})
