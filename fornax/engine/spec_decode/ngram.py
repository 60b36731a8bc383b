"""N-gram prompt lookup: propose what followed the last time the sequence's tail occurred.

No model at all: the request's own prompt and output are the "draft model". It wins on
input-grounded work (editing, summarising, code refactoring, RAG answers), where the output
copies long spans of the input, and costs nothing when nothing matches (no proposal).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from fornax.config import SpeculativeConfig
from fornax.engine.request import Request
from fornax.engine.spec_decode import TargetInfo, register_proposer


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching tail."""
    return lookup_with_length(tokens, k, min_n, max_n)[0]


def lookup_with_length(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching tail, and
    that tail's length (0: no match).

    Tries tail lengths max_n down to min_n. Among the occurrences of a tail, the latest one
    with k tokens after it wins (recent context predicts best); if none has k, the latest.
    """
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return [], 0
    seq = np.asarray(tokens, dtype=np.int64)
    # Every earlier occurrence of a tail ends on a copy of the last token: find those once,
    # then keep the ones whose preceding tokens match too, one tail length at a time. (Each
    # step costs the survivors, not the sequence: one pass over it in all.)
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # last index of each one-token occurrence
    survivors = [ends]  # survivors[n - 1]: last indices of the occurrences of the n-token tail
    for n in range(2, min(max_n, length - 1) + 1):
        prev = survivors[-1]
        prev = prev[prev >= n - 1]
        survivors.append(prev[seq[prev - (n - 1)] == seq[-n]])
    for n in range(len(survivors), min_n - 1, -1):
        hits = survivors[n - 1]
        if hits.size == 0:
            continue
        after = hits + 1  # first token after each occurrence; always < length
        full = after[after + k <= length]
        start = int(full[-1] if full.size else after[-1])
        return tokens[start : start + k], n
    return [], 0


class NgramProposer:
    cost_per_token = 0.0  # a lookup in a list: nothing next to a forward pass

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [drafts for drafts, _ in self.propose_with_kinds(requests, num_tokens)]

    def propose_with_kinds(
        self, requests: list[Request], num_tokens: list[int]
    ) -> list[tuple[list[int], int]]:
        """Drafts with the matched tail's length as their kind (the controller's KindedProposer)."""
        return [
            lookup_with_length(r.all_token_ids, k, self.min_n, self.max_n)
            for r, k in zip(requests, num_tokens)
        ]

    def setup_cost(self, request: Request) -> float:
        return 0.0

    def drop(self, request_ids: Iterable[str]) -> None:
        pass  # stateless


@register_proposer("ngram")
def _build(config: SpeculativeConfig, target: TargetInfo) -> NgramProposer:
    return NgramProposer(config)
