"""Verification of draft tokens: which drafts the target accepts, and its own next token.

A request with k drafts d_0..d_{k-1} brings k + 1 rows of target logits: row j is the
target's distribution for the token after d_0..d_{j-1}. Each row is processed exactly as the
plain sampler would process it at that point of the sequence (logit bias, min_tokens,
penalties counting the drafts before it, temperature, top-k/top-p/min-p), so the result is
lossless:

* greedy rows accept d_j while it equals the row's argmax; the first mismatch (or row k,
  when every draft is accepted) gives the target's argmax as the extra token, which is
  exactly the token plain greedy decoding would have produced;
* random rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Drafts here
  are deterministic proposals (the draft distribution q is one-hot), for which the rule is:
  accept d_j with probability p_j(d_j); on the first rejection, draw from p_j with d_j
  removed and renormalised, i.e. norm(max(p_j - q_j, 0)); if all are accepted, draw the
  extra token from p_k. Each emitted token is then distributed exactly as p.

Every verifying random request draws exactly k + 1 uniforms per step, from its own
generator when seeded, so a seeded request reproduces whatever shares its batch.

Deterministic mode (positional=True, docs/deterministic.md) verifies random rows by matching
instead: each row draws the token plain sampling would draw at that position (the same
function, a draw seeded by the position), and d_j is accepted while it equals that token.
With a one-hot q this accepts d_j with probability p_j(d_j), as rejection sampling does, and
emits exactly the tokens a run without speculation emits for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fornax.engine.outputs import TokenLogprobs
from fornax.engine.request import Request, SamplingParams
from fornax.engine.sample.metadata import SamplingMetadata
from fornax.engine.sample.sampler import filter_random_logits, gather_logprobs, process_logits, sample
from fornax.engine.structured.backend import GrammarState
from fornax.engine.structured.masks import GrammarMask


@dataclass
class DraftRow:
    """A request as seen at one verification row: its outputs extended by the drafts before it.

    Duck-types the fields of Request that SamplingMetadata.build reads, so penalties and
    min_tokens treat the drafts as if they had been generated.
    """

    request: Request
    drafts_before: list[int]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        if not self.drafts_before:
            return self.request.output_token_ids
        return self.request.output_token_ids + self.drafts_before

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts_before)

    @property
    def grammar(self) -> GrammarState | None:
        return self.request.grammar


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: accepted drafts, then the target's token
    logprobs: list[list[TokenLogprobs] | None]  # per request, one per token when asked


def verify_drafts(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab] float32, k_i + 1 consecutive rows per request
    requests: Sequence[Request],
    drafts: Sequence[list[int]],
    generators: dict[str, torch.Generator],
    grammar_mask: GrammarMask | None = None,
    positional: bool = False,
) -> VerifyResult:
    """Accept a prefix of each request's drafts and sample the token after it. Constrained
    requests verify against the grammar-masked target (`grammar_mask`: the mask after each
    prefix of their drafts), so a draft the grammar forbids has probability 0 and is rejected
    and the token taken in its place obeys the grammar; logprobs stay the raw model's."""
    rows = [DraftRow(r, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
    meta = SamplingMetadata.build(rows, generators, positional=positional)  # DraftRow duck-types Request
    meta.grammar_mask = grammar_mask
    processed = process_logits(logits.float(), meta)  # [R, vocab]
    if positional:
        choice = sample(processed, meta).tolist()  # [R]: each row's token as plain sampling draws it
        tokens, first = [], 0
        for d in drafts:
            tokens.append(_accept_greedy(d, choice[first : first + len(d) + 1]))
            first += len(d) + 1
        return VerifyResult(tokens, _logprobs(logits, requests, drafts, tokens))
    greedy_choice = None if meta.all_random else processed.argmax(dim=-1).tolist()  # [R]
    probs = None  # [num_random_rows, vocab], the exact distribution each random row samples from
    random_pos: dict[int, int] = {}  # batch row -> row of `probs`
    if not meta.all_greedy:
        random_rows = list(range(len(rows))) if meta.random_rows is None else meta.random_rows.tolist()
        random_pos = {row: i for i, row in enumerate(random_rows)}
        picked = processed if meta.random_rows is None else processed[meta.random_rows]
        probs = torch.softmax(filter_random_logits(picked, meta), dim=-1)
    tokens: list[list[int]] = []
    first = 0
    for request, d in zip(requests, drafts):
        if request.sampling_params.greedy:
            assert greedy_choice is not None
            tokens.append(_accept_greedy(d, greedy_choice[first : first + len(d) + 1]))
        else:
            assert probs is not None
            p = probs[random_pos[first] : random_pos[first] + len(d) + 1]  # [k + 1, vocab]
            tokens.append(_accept_random(d, p, generators.get(request.request_id)))
        first += len(d) + 1
    return VerifyResult(tokens, _logprobs(logits, requests, drafts, tokens))


def _accept_greedy(drafts: list[int], choice: list[int]) -> list[int]:
    n = 0
    while n < len(drafts) and drafts[n] == choice[n]:
        n += 1
    return drafts[:n] + [choice[n]]


def _accept_random(drafts: list[int], p: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """p: [k + 1, vocab] target probabilities per row. Draws k + 1 uniforms, always."""
    k = len(drafts)
    uniform = torch.rand(k + 1, generator=generator) if generator is not None else torch.rand(k + 1)
    if k:
        p_draft = p[torch.arange(k), torch.tensor(drafts)]  # [k]
        rejected = (uniform[:k] >= p_draft).nonzero()  # accept d_j iff u_j < p_j(d_j)
        n = int(rejected[0, 0]) if rejected.numel() else k
    else:
        n = 0
    weights = p[n].clone()  # [vocab]
    if n < k:
        weights[drafts[n]] = 0.0  # the residual max(p - q, 0) for a one-hot q
    cdf = weights.cumsum(dim=0)  # [vocab], unnormalised
    target = (1.0 - uniform[k]) * cdf[-1]  # in (0, total]: never a zero-weight token
    token = int(torch.searchsorted(cdf, target.unsqueeze(0))[0].clamp(max=cdf.shape[0] - 1))
    return drafts[:n] + [token]


def _logprobs(
    logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]], tokens: list[list[int]]
) -> list[list[TokenLogprobs] | None]:
    """Raw-model logprobs (like the plain sampler's) of each emitted token at its own row."""
    out: list[list[TokenLogprobs] | None] = [None] * len(requests)
    rows: list[int] = []
    ids: list[int] = []
    owners: list[int] = []
    first = 0
    for i, (request, d) in enumerate(zip(requests, drafts)):
        if request.sampling_params.logprobs is not None:
            rows.extend(range(first, first + len(tokens[i])))
            ids.extend(tokens[i])
            owners.extend([i] * len(tokens[i]))
            out[i] = []
        first += len(d) + 1
    if not rows:
        return out
    max_k = max(requests[i].sampling_params.logprobs or 0 for i in set(owners))
    raw = torch.log_softmax(logits[torch.tensor(rows)].float(), dim=-1)  # [n, vocab]
    lp = gather_logprobs(raw, torch.tensor(ids), max_k)
    for (t, v, r, ti, tl), i in zip(zip(*lp.lists), owners):
        k = requests[i].sampling_params.logprobs or 0
        entries = out[i]
        assert entries is not None
        entries.append(TokenLogprobs(token_id=t, logprob=v, rank=r, top_ids=ti[:k], top_logprobs=tl[:k]))
    return out
