"""SamplingMetadata: every request's sampling parameters as batch tensors, built once per step.

The sampler never looks at a Request: the runner calls `SamplingMetadata.build` once per
step and the sampler works on the tensors only (docs/architecture.md, rule 7). Each optional stage
(penalties, logit bias, min_tokens, top-k, top-p, min-p, logprobs) is `None` when no row
in the batch uses it, so a batch of plain requests pays for none of them.

Two row spaces appear here:
  * batch rows `[num_reqs]`: logprobs, logit bias, min_tokens and penalties (they change
    the logits that greedy rows take the argmax of, too);
  * random rows `[num_random]`: temperature, min-p, top-k, top-p and the generators. Only
    rows with temperature > 0 are ever sorted or sampled, so greedy rows cost nothing there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from fornax.engine.request import Request
from fornax.engine.structured.masks import GrammarMask

# torch.Generator accepts seeds in [-2**63, 2**64); SamplingParams validates that range.


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's private RNG: its draws depend on its seed only, never on the batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, index: int) -> int:
    """The seed of a request's draw for its output token `index` (deterministic mode): a
    splitmix64-style mix of both, so that the draw depends on which token it is and not on how
    many numbers the request drew before it (a verify step draws for several positions, a
    plain step for one)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class PenaltyMetadata:
    """Penalties for the subset of rows that use any (`rows`); other rows are untouched."""

    rows: torch.Tensor | None  # [P] long batch rows; None: every row of the batch
    presence: torch.Tensor | None  # [P] float32; None when no row sets presence/frequency
    frequency: torch.Tensor | None  # [P] float32
    repetition: torch.Tensor | None  # [P] float32 (1.0 = off); None when no row sets it
    # Generated tokens, flattened: token `output_ids[j]` belongs to penalty row `output_rows[j]`.
    # Flat (row, id) pairs let one bincount make the [P, vocab] count matrix without padding.
    output_ids: torch.Tensor  # [T_out] long
    output_rows: torch.Tensor  # [T_out] long, in [0, P)
    # Prompt tokens, only for rows with a repetition penalty (HF/vLLM apply it to the prompt too).
    prompt_ids: torch.Tensor | None  # [T_prompt] long
    prompt_rows: torch.Tensor | None  # [T_prompt] long


@dataclass
class SamplingMetadata:
    num_reqs: int
    all_greedy: bool
    all_random: bool
    # -- random rows --
    random_rows: torch.Tensor | None  # [num_random] long batch rows; None when all_random or all_greedy
    temperature: torch.Tensor | None  # [num_random] float32; None when all_greedy
    top_k: torch.Tensor | None  # [num_random] long, 0 = off; None when no random row sets it
    top_p: torch.Tensor | None  # [num_random] float32, 1.0 = off; None when no random row sets it
    min_p: torch.Tensor | None  # [num_random] float32, 0.0 = off; None when no random row sets it
    # Position in the random rows -> that request's own generator (seeded requests only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # -- batch rows --
    # Sparse logit bias: logits[bias_rows[j], bias_ids[j]] += bias_values[j].
    bias_rows: torch.Tensor | None = None  # [B] long
    bias_ids: torch.Tensor | None = None  # [B] long
    bias_values: torch.Tensor | None = None  # [B] float32
    # Sparse min_tokens mask: logits[min_tokens_rows[j], min_tokens_ids[j]] = -inf.
    min_tokens_rows: torch.Tensor | None = None  # [M] long
    min_tokens_ids: torch.Tensor | None = None  # [M] long
    penalties: PenaltyMetadata | None = None
    # Constrained decoding: the constrained rows and their token bitmasks (0 = forbidden by the
    # row's grammar; engine/structured/masks.py). Set by the runner; other rows are untouched.
    grammar_mask: GrammarMask | None = None
    # -- logprobs --
    max_num_logprobs: int | None = None  # largest `logprobs` asked in the batch; None: nobody asked
    num_logprobs: list[int | None] = field(default_factory=list)  # per batch row

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def needs_processing(self) -> bool:
        """True when any stage changes the logits before greedy argmax / temperature."""
        return (
            self.bias_rows is not None
            or self.min_tokens_rows is not None
            or self.penalties is not None
            or self.grammar_mask is not None
        )

    @classmethod
    def build(
        cls,
        requests: list[Request],
        generators: dict[str, torch.Generator],
        device: str | torch.device = "cpu",
        positional: bool = False,
    ) -> SamplingMetadata:
        """Per-row tensors for one step, in `requests` order (== the logits' row order).

        `generators` is the runner's per-request store (request_id -> Generator), kept across
        steps so a seeded request's stream continues where it left off; a seeded request
        missing from it gets one here, created from its seed. positional (deterministic mode):
        each seeded row draws instead from a generator of its own, seeded by position_seed for
        the output token it samples, so the draw for a token is the same whether a plain step
        or a verify step takes it.
        """
        params = [r.sampling_params for r in requests]
        random_idx = [i for i, p in enumerate(params) if not p.greedy]
        all_greedy = not random_idx
        all_random = len(random_idx) == len(requests)
        meta = cls(
            num_reqs=len(requests),
            all_greedy=all_greedy,
            all_random=all_random,
            random_rows=None if all_greedy or all_random else _long(random_idx, device),
            temperature=None,
            top_k=None,
            top_p=None,
            min_p=None,
        )
        if not all_greedy:
            _fill_random(meta, requests, random_idx, generators, device, positional)
        _fill_logit_bias(meta, requests, device)
        _fill_min_tokens(meta, requests, device)
        meta.penalties = _build_penalties(requests, device)
        meta.num_logprobs = [p.logprobs for p in params]
        asked = [k for k in meta.num_logprobs if k is not None]
        meta.max_num_logprobs = max(asked) if asked else None
        return meta


def _long(values: list[int], device: str | torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: str | torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _fill_random(
    meta: SamplingMetadata,
    requests: list[Request],
    random_idx: list[int],
    generators: dict[str, torch.Generator],
    device: str | torch.device,
    positional: bool,
) -> None:
    params = [requests[i].sampling_params for i in random_idx]
    meta.temperature = _float([p.temperature for p in params], device)  # [num_random]
    if any(p.top_k > 0 for p in params):
        meta.top_k = _long([p.top_k for p in params], device)  # [num_random]
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = _float([p.top_p for p in params], device)  # [num_random]
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = _float([p.min_p for p in params], device)  # [num_random]
    for pos, i in enumerate(random_idx):
        request = requests[i]
        seed = request.sampling_params.seed
        if seed is None:
            continue
        if positional:
            meta.generators[pos] = make_generator(position_seed(seed, request.num_output_tokens), device)
            continue
        generator = generators.get(request.request_id)
        if generator is None:
            generator = generators[request.request_id] = make_generator(seed, device)
        meta.generators[pos] = generator


def _fill_logit_bias(meta: SamplingMetadata, requests: list[Request], device: str | torch.device) -> None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, request in enumerate(requests):
        bias = request.sampling_params.logit_bias
        if bias:
            rows.extend(itertools.repeat(i, len(bias)))
            ids.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        meta.bias_rows = _long(rows, device)  # [B]
        meta.bias_ids = _long(ids, device)  # [B]
        meta.bias_values = _float(values, device)  # [B]


def _fill_min_tokens(meta: SamplingMetadata, requests: list[Request], device: str | torch.device) -> None:
    # min_tokens forbids ending early: EOS is blocked even with ignore_eos (the request asked
    # for at least N real tokens, and an EOS token in the text is not one), and so are the
    # request's stop_token_ids.
    rows: list[int] = []
    ids: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        # A constrained row ends where its grammar does: blocking EOS there would leave no token.
        if request.num_output_tokens >= params.min_tokens or request.grammar is not None:
            continue
        blocked = set(request.eos_token_ids).union(params.stop_token_ids or ())
        rows.extend(itertools.repeat(i, len(blocked)))
        ids.extend(blocked)
    if rows:
        meta.min_tokens_rows = _long(rows, device)  # [M]
        meta.min_tokens_ids = _long(ids, device)  # [M]


def _build_penalties(requests: list[Request], device: str | torch.device) -> PenaltyMetadata | None:
    def uses_penalty(r: Request) -> bool:
        p = r.sampling_params
        return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0

    rows = [i for i, r in enumerate(requests) if uses_penalty(r)]
    if not rows:
        return None
    params = [requests[i].sampling_params for i in rows]
    has_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    has_repetition = any(p.repetition_penalty != 1.0 for p in params)
    # The token lists are flattened in Python once per step: O(tokens of penalised rows).
    output_lists = [requests[i].output_token_ids for i in rows]
    prompt_ids = prompt_rows = None
    if has_repetition:
        prompt_lists = [
            requests[i].prompt_token_ids if requests[i].sampling_params.repetition_penalty != 1.0 else []
            for i in rows
        ]
        prompt_ids, prompt_rows = _flatten(prompt_lists, device)
    output_ids, output_rows = _flatten(output_lists, device)
    return PenaltyMetadata(
        rows=None if len(rows) == len(requests) else _long(rows, device),
        presence=_float([p.presence_penalty for p in params], device) if has_additive else None,
        frequency=_float([p.frequency_penalty for p in params], device) if has_additive else None,
        repetition=_float([p.repetition_penalty for p in params], device) if has_repetition else None,
        output_ids=output_ids,
        output_rows=output_rows,
        prompt_ids=prompt_ids,
        prompt_rows=prompt_rows,
    )


def _flatten(lists: list[list[int]], device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, row of each id) for a ragged list of token lists."""
    ids = _long(list(itertools.chain.from_iterable(lists)), device)  # [T]
    lengths = _long([len(x) for x in lists], device)  # [P]
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)  # [T]
    return ids, rows
