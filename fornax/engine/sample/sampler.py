"""Batched sampling: logits [num_reqs, vocab] + SamplingMetadata -> one token per row.

The order of a step, which follows vLLM:
  1. raw logprobs, if any row asked (OpenAI semantics: the model's own distribution,
     before any penalty, bias or temperature);
  2. `process_logits`: logit bias, min_tokens mask, penalties (these change what greedy
     rows pick too);
  3. greedy rows: argmax of the processed logits;
  4. random rows: temperature, min-p, top-k, top-p, then one draw per row.

Every stage is skipped when no row uses it. The random draw is an exponential race:
argmax_i(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i, and it lets a
seeded row draw its noise from its own generator, so a seed gives the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fornax.engine.outputs import TokenLogprobs
from fornax.engine.sample.metadata import PenaltyMetadata, SamplingMetadata

# Prompt logprobs are computed in slices of this many positions so a long prefill never
# holds a whole [num_prompt_tokens, vocab] float32 log_softmax at once.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class LogprobsTensors:
    """Logprobs of the raw distribution for every row of the batch."""

    token_logprobs: torch.Tensor  # [num_reqs] float32: logprob of the sampled token
    token_ranks: torch.Tensor  # [num_reqs] long: 1-based rank of the sampled token
    top_ids: torch.Tensor  # [num_reqs, max_num_logprobs] long, best first
    top_logprobs: torch.Tensor  # [num_reqs, max_num_logprobs] float32

    @functools.cached_property
    def lists(self) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
        """The same values as Python lists, converted once however many rows are read."""
        return (
            self.token_logprobs.tolist(),
            self.token_ranks.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] long
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [num_reqs, vocab]; a no-op for float32 input
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
        logits = process_logits(logits, meta)
        sampled = sample(logits, meta)  # [num_reqs]
        logprobs = None
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


# -- stage 2: processing shared by greedy and random rows --


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, then the min_tokens mask, then penalties. Never modifies `logits`.

    The mask comes after the bias so that no bias can re-enable a blocked EOS.
    """
    if not meta.needs_processing:
        return logits
    logits = logits.clone()  # [num_reqs, vocab]: the caller's tensor stays the model's output
    if meta.bias_rows is not None:
        assert meta.bias_ids is not None and meta.bias_values is not None
        # (row, id) pairs are unique (dict keys per row), so a plain indexed add is exact.
        logits.index_put_((meta.bias_rows, meta.bias_ids), meta.bias_values, accumulate=True)
    if meta.min_tokens_rows is not None:
        assert meta.min_tokens_ids is not None
        logits[meta.min_tokens_rows, meta.min_tokens_ids] = float("-inf")
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> None:
    """In place. Repetition: logits of seen tokens (prompt or output) are divided by the
    penalty when positive and multiplied when negative; frequency subtracts freq * count and
    presence subtracts presence * (count > 0), counting generated tokens only."""
    vocab = logits.shape[-1]
    sub = logits if pen.rows is None else logits[pen.rows]  # [P, vocab]
    num_rows = sub.shape[0]
    counts = _row_bincount(pen.output_rows, pen.output_ids, num_rows, vocab)  # [P, vocab]
    if pen.repetition is not None:
        seen = counts > 0  # [P, vocab]
        if pen.prompt_ids is not None and pen.prompt_rows is not None:
            seen |= _row_bincount(pen.prompt_rows, pen.prompt_ids, num_rows, vocab) > 0
        factor = pen.repetition.unsqueeze(1)  # [P, 1]
        penalised = torch.where(sub > 0, sub / factor, sub * factor)  # [P, vocab]
        sub = torch.where(seen, penalised, sub)
    if pen.frequency is not None and pen.presence is not None:
        sub = sub - pen.frequency.unsqueeze(1) * counts - pen.presence.unsqueeze(1) * (counts > 0)
    if pen.rows is None:
        logits.copy_(sub)
    else:
        logits[pen.rows] = sub


def _row_bincount(rows: torch.Tensor, ids: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """counts[r, t] = how often token t occurs among the ids of row r."""
    flat = torch.bincount(rows * vocab + ids, minlength=num_rows * vocab)  # [num_rows * vocab]
    return flat.view(num_rows, vocab).to(torch.float32)  # [num_rows, vocab]


# -- stages 3 and 4: choosing the token --


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row from processed logits [num_reqs, vocab] -> [num_reqs] long."""
    greedy = None if meta.all_random else logits.argmax(dim=-1)  # [num_reqs]
    if meta.all_greedy:
        assert greedy is not None
        return greedy
    rand_logits = logits if meta.random_rows is None else logits[meta.random_rows]  # [num_random, vocab]
    rand_logits = filter_random_logits(rand_logits, meta)
    rand_tokens = exponential_race(rand_logits, meta.generators)  # [num_random]
    if greedy is None:
        return rand_tokens
    assert meta.random_rows is not None
    return greedy.index_copy_(0, meta.random_rows, rand_tokens)


def filter_random_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p for the random rows. Never modifies `logits`."""
    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)  # [num_random, vocab]; also the private copy
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p * (the top token's probability)."""
    probs = torch.softmax(logits, dim=-1)  # [n, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [n, 1]; 0 for rows with min_p off
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """In place. top_k: [n] long, 0 = off; top_p: [n] float, 1.0 = off. Top-p acts on the
    distribution left after top-k (renormalised), as in vLLM and HF."""
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        _apply_top_k_only(logits, top_k)
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab] each
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)  # [n]
        beyond_k = torch.arange(vocab, device=logits.device) >= k.unsqueeze(1)  # [n, vocab]
        sorted_logits.masked_fill_(beyond_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [n, vocab]
    mass_before = probs.cumsum(dim=-1) - probs  # [n, vocab]: mass of the strictly better tokens
    # A token is outside the nucleus once the better tokens already hold top_p. The best token
    # has mass_before 0 < top_p, so it always stays. Rows with top_p == 1 are left alone:
    # rounding in the cumsum could otherwise cut a far tail.
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)  # [n, vocab]
    sorted_logits.masked_fill_(outside, float("-inf"))
    logits.scatter_(-1, order, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    # A partial topk up to the largest k is much cheaper than sorting the whole vocabulary.
    vocab = logits.shape[-1]
    enabled = top_k > 0  # [n]
    k = torch.where(enabled, top_k.clamp(max=vocab), 1)  # [n]
    top_values = logits.topk(int(k.max()), dim=-1).values  # [n, max_k]
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [n, 1]: the k-th best logit
    threshold.masked_fill_(~enabled.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_race(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row of logits [n, vocab] -> [n] long.

    argmax(p / E), E ~ Exp(1) i.i.d.: E_i / p_i is Exp(p_i), and the smallest of independent
    exponentials is i with probability p_i / sum(p). Unseeded rows share one batched draw;
    each seeded row draws its own noise from its generator.
    """
    probs = torch.softmax(logits, dim=-1)  # [n, vocab]
    noise = torch.empty_like(probs)  # [n, vocab]
    num_rows = probs.shape[0]
    if not generators:
        noise.exponential_()
    elif len(generators) < num_rows:
        unseeded = [i for i in range(num_rows) if i not in generators]
        unseeded_idx = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        noise[unseeded_idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # An exact 0 from the draw would make 0/0 = nan for a filtered token, and argmax favours nan.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


# -- logprobs --


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob and rank of token_ids [n] in logprobs [n, vocab], plus the top-k of each row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    # Competition rank: 1 + number of strictly more likely tokens (ties share a rank).
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [n, k] each
    return LogprobsTensors(
        token_logprobs=chosen.squeeze(1),
        token_ranks=ranks,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def to_token_logprobs(output: SamplerOutput, row: int, k: int) -> TokenLogprobs:
    """The logprobs of batch row `row` with its own top-k (k <= the batch's max_num_logprobs)."""
    if output.logprobs is None:
        raise ValueError("this step computed no logprobs: no request in the batch asked for them")
    token_logprobs, ranks, top_ids, top_logprobs = output.logprobs.lists
    return TokenLogprobs(
        token_id=int(output.sampled_token_ids[row]),
        logprob=token_logprobs[row],
        rank=ranks[row],
        top_ids=top_ids[row][:k],
        top_logprobs=top_logprobs[row][:k],
    )


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Logprobs of each prompt token given the ones before it.

    logits [n, vocab] are the model's outputs at n consecutive prompt positions and
    next_token_ids [n] the prompt tokens that follow each of them.
    """
    results: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK):
        chunk = logits[start : start + PROMPT_LOGPROBS_CHUNK].float()  # [c, vocab]
        ids = next_token_ids[start : start + PROMPT_LOGPROBS_CHUNK]  # [c]
        lp = gather_logprobs(torch.log_softmax(chunk, dim=-1), ids, k)
        token_logprobs, ranks, top_ids, top_logprobs = lp.lists
        results.extend(
            TokenLogprobs(token_id=t, logprob=v, rank=r, top_ids=ti, top_logprobs=tl)
            for t, v, r, ti, tl in zip(ids.tolist(), token_logprobs, ranks, top_ids, top_logprobs)
        )
    return results
