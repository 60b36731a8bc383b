"""Batched sampling: logits [num_reqs, vocab] + SamplingMetadata -> one token per row.

The order of a step, which follows vLLM:
  1. raw logprobs, if any row asked (OpenAI semantics: the model's own distribution,
     before any penalty, bias or temperature);
  2. `process_logits`: logit bias, min_tokens mask, penalties, then the grammar mask of
     constrained rows (these change what greedy rows pick too);
  3. greedy rows: argmax of the processed logits;
  4. random rows: temperature, min-p, top-k, top-p, then one draw per row.

Every stage is skipped when no row uses it. The random draw takes one uniform number per
row (inverse CDF); a seeded row takes its number from its own generator, so a seed gives
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fornax.engine.outputs import TokenLogprobs
from fornax.engine.sample.metadata import PenaltyMetadata, SamplingMetadata
from fornax.engine.structured.backend import apply_bitmask

# Top-p sorts only this many best logits at first, widening (x4) only for rows whose
# nucleus is larger.
TOP_P_FIRST_WIDTH = 256
# Prompt logprobs are computed in slices of this many positions so a long prefill never
# holds a whole [num_prompt_tokens, vocab] float32 log_softmax at once.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class LogprobsTensors:
    """Logprobs of the raw distribution for every row of the batch."""

    token_ids: torch.Tensor  # [num_reqs] long: the tokens the logprobs are of
    token_logprobs: torch.Tensor  # [num_reqs] float32: logprob of the sampled token
    token_ranks: torch.Tensor  # [num_reqs] long: 1-based rank of the sampled token
    top_ids: torch.Tensor  # [num_reqs, max_num_logprobs] long, best first
    top_logprobs: torch.Tensor  # [num_reqs, max_num_logprobs] float32

    @functools.cached_property
    def lists(self) -> tuple[list[int], list[float], list[int], list[list[int]], list[list[float]]]:
        """The same values as Python lists, converted once however many rows are read."""
        return (
            self.token_ids.tolist(),
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
    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, consume_logits: bool = False
    ) -> SamplerOutput:
        """`consume_logits`: the caller will not read `logits` again, so processing may
        overwrite them instead of copying (the runner's case)."""
        logits = logits.float()  # [num_reqs, vocab]; a no-op for float32 input
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
        logits = process_logits(logits, meta, inplace=consume_logits)
        sampled = sample(logits, meta)  # [num_reqs]
        logprobs = None
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


# -- stage 2: processing shared by greedy and random rows --


def process_logits(logits: torch.Tensor, meta: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
    """Logit bias, then the min_tokens mask, then penalties, then the grammar mask. Never
    modifies `logits` unless `inplace` (then a contiguous `logits` is processed where it is:
    copying [16, 49152] float32 cost ~0.3 ms a step).

    The masks come after the bias so that no bias can re-enable a blocked token. The grammar
    mask is one batched call over the constrained rows; the other rows are never touched.
    """
    if not meta.needs_processing:
        return logits
    # The caller's tensor stays the model's output unless it gave it up; contiguous so penalties
    # can use a flat view.
    if not (inplace and logits.is_contiguous()):
        logits = logits.clone(memory_format=torch.contiguous_format)  # [num_reqs, vocab]
    if meta.bias_rows is not None:
        assert meta.bias_ids is not None and meta.bias_values is not None
        # (row, id) pairs are unique (dict keys per row), so a plain indexed add is exact.
        logits.index_put_((meta.bias_rows, meta.bias_ids), meta.bias_values, accumulate=True)
    if meta.min_tokens_rows is not None:
        assert meta.min_tokens_ids is not None
        logits[meta.min_tokens_rows, meta.min_tokens_ids] = float("-inf")
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    if meta.grammar_mask is not None:
        apply_bitmask(logits, meta.grammar_mask.bitmask, meta.grammar_mask.rows)
    return logits


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> None:
    """In place on contiguous logits [num_reqs, vocab].

    Repetition: the logit of each token seen (prompt or output) is divided by the penalty
    when positive and multiplied by it when negative. Then frequency subtracts
    freq * count and presence subtracts presence * (count > 0), counting generated tokens.
    Only the (row, token) pairs that occur are touched: O(tokens), not O(rows * vocab).
    """
    vocab = logits.shape[-1]
    flat = logits.view(-1)  # [num_reqs * vocab]
    out_keys = pen.output_rows * vocab + pen.output_ids  # [T_out]: penalty row * vocab + token
    if pen.repetition is not None:
        keys = out_keys
        if pen.prompt_ids is not None and pen.prompt_rows is not None:
            keys = torch.cat([out_keys, pen.prompt_rows * vocab + pen.prompt_ids])  # [T_out + T_prompt]
        index, prow = _flat_index(torch.unique(keys), pen.rows, vocab)  # [S] each
        values = flat[index]  # [S]
        factor = pen.repetition[prow]  # [S]
        flat[index] = torch.where(values > 0, values / factor, values * factor)
    if pen.frequency is not None and pen.presence is not None:
        keys, counts = torch.unique(out_keys, return_counts=True)  # [U] each
        index, prow = _flat_index(keys, pen.rows, vocab)
        flat[index] -= pen.frequency[prow] * counts + pen.presence[prow]


def _flat_index(
    keys: torch.Tensor, rows: torch.Tensor | None, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (penalty row * vocab + token) -> (index into the flat logits, penalty row)."""
    prow = torch.div(keys, vocab, rounding_mode="floor")  # [S]
    token = keys - prow * vocab  # [S]
    batch_row = prow if rows is None else rows[prow]  # [S]
    return batch_row * vocab + token, prow


# -- stages 3 and 4: choosing the token --


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row from processed logits [num_reqs, vocab] -> [num_reqs] long."""
    greedy = None if meta.all_random else logits.argmax(dim=-1)  # [num_reqs]
    if meta.all_greedy:
        assert greedy is not None
        return greedy
    assert meta.temperature is not None
    rand_logits = logits if meta.random_rows is None else logits[meta.random_rows]  # [num_random, vocab]
    threshold = random_thresholds(rand_logits, meta)  # [num_random, 1] or None
    rand_tokens = draw_tokens(rand_logits, meta.temperature, threshold, meta.generators)  # [num_random]
    if greedy is None:
        return rand_tokens
    assert meta.random_rows is not None
    return greedy.index_copy_(0, meta.random_rows, rand_tokens)


# Every filter (min-p, top-k, top-p) keeps the tokens at or above a per-row cut-off logit,
# so the filters only compute cut-offs [n, 1] and the draw applies them while it
# exponentiates: no full-vocabulary copy per filter. Cut-offs are in raw-logit space;
# temperature (a positive scale) keeps the order, so it only enters the probabilities.


def random_thresholds(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """Cut-off logits [n, 1] for random rows logits [n, vocab]: min-p, then top-k, then
    top-p over what is left. None when no row filters."""
    assert meta.temperature is not None
    floor = None
    if meta.min_p is not None:
        floor = min_p_threshold(logits, meta.min_p, meta.temperature)
    if meta.top_k is None and meta.top_p is None:
        return floor
    cut = top_k_top_p_threshold(logits, meta.top_k, meta.top_p, meta.temperature, floor)
    return cut if floor is None else torch.maximum(cut, floor)


def filter_random_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows are drawn from, as logits: temperature-scaled, with
    filtered tokens at -inf. For inspection and tests; the sampler fuses this into the draw."""
    assert meta.temperature is not None
    scaled = logits / meta.temperature.unsqueeze(1)  # [n, vocab]
    threshold = random_thresholds(logits, meta)
    return scaled if threshold is None else scaled.masked_fill_(logits < threshold, float("-inf"))


def min_p_threshold(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Cut-off [n, 1] dropping tokens whose probability (at the row's temperature) is below
    min_p * the top token's: p_i < min_p * p_max  <=>  logit_i < max + T * log(min_p).
    No softmax needed; min_p = 0 gives log 0 = -inf, which keeps everything."""
    return logits.amax(dim=-1, keepdim=True) + (temperature * min_p.log()).unsqueeze(1)  # [n, 1]


def top_k_top_p_threshold(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    temperature: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cut-off [n, 1] for top_k ([n] long, 0 = off) and top_p ([n] float, 1.0 = off).

    Top-p acts on the distribution at the row's temperature, renormalised over the tokens
    left by top-k and by `floor` (min-p's cut-off), as vLLM and HF order them. Tokens tied
    with the last one kept stay too.
    """
    vocab = logits.shape[-1]
    if top_k is None:
        k = torch.full((logits.shape[0],), vocab, dtype=torch.long, device=logits.device)  # [n]
    else:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [n]
    if top_p is None:
        return _top_k_threshold(logits, k < vocab, k)
    inv_t = temperature.reciprocal().unsqueeze(1)  # [n, 1]
    p_on = (top_p < 1.0).unsqueeze(1)  # [n, 1]
    # Sorting the whole vocabulary costs ~20x a top-256 on CPU, and a nucleus is usually far
    # smaller: sort only the best `width` logits and widen until every row's cut lies inside.
    width = min(vocab, max(TOP_P_FIRST_WIDTH, int(k.masked_fill(k >= vocab, 0).max())))
    full_log_norm = None
    while True:
        values = logits.topk(width, dim=-1).values  # [n, width], best first
        allowed = torch.arange(width, device=logits.device) < k.unsqueeze(1)  # [n, width]
        if floor is not None:
            allowed &= values >= floor
        scaled = (values * inv_t).masked_fill_(~allowed, float("-inf"))  # [n, width]
        # Renormalise over the allowed set: all among the candidates when k <= width (every
        # row with top-k on: width >= its k); for the others, over the whole row.
        log_norm = scaled.logsumexp(dim=-1, keepdim=True)  # [n, 1]
        beyond = (k > width).unsqueeze(1)  # [n, 1]
        if bool(beyond.any()):
            if full_log_norm is None:
                full_log_norm = _row_log_norm(logits, inv_t, floor)
            log_norm = torch.where(beyond, full_log_norm, log_norm)
        probs = (scaled - log_norm).exp_()  # [n, width]
        # Mass of the strictly better tokens (a shifted cumsum, so that it is monotone).
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [n, width]
        # Outside the nucleus once the better tokens hold top_p; the best token always stays.
        keep = allowed & ((mass_before < top_p.unsqueeze(1)) | ~p_on)  # [n, width], a prefix
        keep[:, :1] = allowed[:, :1]  # even when top_p rounds to 0.0 in float32 (1e-50)
        # Settled: the cut is inside the candidates, or nothing lies beyond them, or top-p
        # is off (then the row's cut is top-k's, which fits, or none).
        settled = ~keep[:, -1:] | ~beyond | ~p_on  # [n, 1]
        if width == vocab or bool(settled.all()):
            break
        width = min(vocab, width * 4)
    num_keep = keep.sum(dim=-1, keepdim=True)  # [n, 1], >= 1
    threshold = values.gather(1, num_keep - 1)  # [n, 1]: the worst logit kept
    # Rows with neither filter keep everything, beyond the candidates too.
    return threshold.masked_fill_(~p_on & beyond, float("-inf"))


def _top_k_threshold(logits: torch.Tensor, enabled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # A partial topk up to the largest k is much cheaper than sorting the whole vocabulary.
    k = torch.where(enabled, k, 1)  # [n]
    top_values = logits.topk(int(k.max()), dim=-1).values  # [n, max_k]
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [n, 1]: the k-th best logit
    return threshold.masked_fill_(~enabled.unsqueeze(1), float("-inf"))


def _row_log_norm(logits: torch.Tensor, inv_t: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    """log sum exp(logit / T) over each whole row's tokens at or above `floor` -> [n, 1]."""
    scaled = logits * inv_t  # [n, vocab]
    if floor is not None:
        scaled.masked_fill_(logits < floor, float("-inf"))
    return scaled.logsumexp(dim=-1, keepdim=True)


def draw_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Sample one token per row of logits [n, vocab] -> [n] long, by inverting the CDF of
    softmax(logits / T) restricted to logits >= threshold [n, 1].

    One uniform number per row: unseeded rows share one batched draw and each seeded row
    takes its number from its own generator, so its token depends on its seed and its own
    logits only. (Vocab-sized noise per row, as in a Gumbel or exponential race, costs
    several times more on CPU: the RNG dominates.)
    """
    num_rows = logits.shape[0]
    # The floor keeps a row whose every logit is -inf (all masked) finite: it draws token 0
    # instead of NaNs, which searchsorted would turn into an id past the vocabulary.
    row_max = logits.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(logits.dtype).min)  # [n, 1]
    shifted = logits - row_max  # [n, vocab], <= 0
    weights = shifted.div_(temperature.unsqueeze(1)).exp_()  # [n, vocab]: best token 1
    if threshold is not None:
        weights.masked_fill_(logits < threshold, 0.0)
    cdf = weights.cumsum_(dim=-1)  # [n, vocab], unnormalised
    uniform = torch.empty(num_rows, 1, device=logits.device)  # [n, 1] in [0, 1)
    if len(generators) < num_rows:
        uniform.uniform_()  # seeded rows are overwritten below
    for row, generator in generators.items():
        uniform[row, 0] = torch.rand((), generator=generator, device=logits.device)
    # target in (0, total]: the first cdf >= target is never a zero-weight token (its cdf
    # equals its predecessor's, which would be found first) and never past the end.
    target = (1.0 - uniform) * cdf[:, -1:]  # [n, 1]
    return torch.searchsorted(cdf, target).squeeze(1)  # [n]


# -- logprobs --


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob and rank of token_ids [n] in logprobs [n, vocab], plus the top-k of each row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    # Competition rank: 1 + number of strictly more likely tokens (ties share a rank).
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [n, k] each
    return LogprobsTensors(
        token_ids=token_ids,
        token_logprobs=chosen.squeeze(1),
        token_ranks=ranks,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def to_token_logprobs(output: SamplerOutput, row: int, k: int) -> TokenLogprobs:
    """The logprobs of batch row `row` with its own top-k (k <= the batch's max_num_logprobs)."""
    if output.logprobs is None:
        raise ValueError("this step computed no logprobs: no request in the batch asked for them")
    token_ids, token_logprobs, ranks, top_ids, top_logprobs = output.logprobs.lists
    return TokenLogprobs(
        token_id=token_ids[row],
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
        results.extend(
            TokenLogprobs(token_id=t, logprob=v, rank=r, top_ids=ti, top_logprobs=tl)
            for t, v, r, ti, tl in zip(*lp.lists)
        )
    return results
