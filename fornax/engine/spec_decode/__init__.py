"""Speculative decoding: proposers guess the next tokens cheaply, the target verifies them.

A proposer is a small Protocol with a registry (docs/architecture.md, rule 8). The engine core asks the
`SpecController` for drafts before each schedule(); the scheduler fits them into the step as
extra tokens of a decode (num_new_tokens = 1 + k); the runner verifies them
(engine/sample/rejection.py); the scheduler keeps the accepted ones and rolls back the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from fornax.config import SpeculativeConfig
from fornax.engine.executor import DraftStep
from fornax.engine.request import Request
from fornax.models import LoadedModel


class Proposer(Protocol):
    """Guesses up to num_tokens[i] tokens that follow requests[i]'s known tokens.

    Proposals are deterministic guesses (the verifier treats them as one-hot drafts), and
    may be shorter than asked, or empty.
    """

    # Cost of one draft token, in units of a target decode step's fixed cost (n-gram: 0).
    cost_per_token: float

    def setup_cost(self, request: Request) -> float:
        """One-off cost (decode-step units) of drafting for this request now: a draft model
        must first run the tokens it has not seen (the prompt, or what passed while paused)."""
        ...

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]: ...

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests: free any per-request state."""
        ...


@runtime_checkable
class KindedProposer(Proposer, Protocol):
    """A proposer cheap enough to be asked for full drafts before the step's drafts are
    budgeted, which says what kind of evidence each proposal rests on (n-gram: the length of
    the matched tail; never 0, the kind of every proposal of a proposer without kinds).
    Acceptance differs by kind far more than by request (docs/speculative-decoding.md), so
    the controller budgets each proposal by its own kind's rate."""

    def propose_with_kinds(
        self, requests: list[Request], num_tokens: list[int]
    ) -> list[tuple[list[int], int]]: ...


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer may need from the engine it serves."""

    loaded: LoadedModel
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    attention_kernel: object | None = None  # the target's native paged-attention kernel, if loaded
    small_step_max_rows: int = 0  # the engine's limit for small-step weight forms (EngineConfig)
    # Tensor parallelism: tells the worker ranks to run a self-draft's step with this process
    # (input ids, positions, spans), since the draft's layers are slices of the target's.
    draft_step_to_ranks: DraftStep | None = None


ProposerFactory = Callable[[SpeculativeConfig, TargetInfo], Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(method: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def deco(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[method] = factory
        return factory

    return deco


def build_proposer(config: SpeculativeConfig, target: TargetInfo) -> Proposer:
    # Importing the implementations fills the registry.
    from fornax.engine.spec_decode import draft_model, ngram, self_draft  # noqa: F401

    return PROPOSERS[config.method](config, target)
