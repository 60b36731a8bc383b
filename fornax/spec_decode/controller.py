"""Which requests speculate this step, and how far: the adaptive rule around a Proposer.

Speculation must never make decoding much slower. Drafts that are rejected cost verify
work (and draft-model work) for nothing, so:

* each request keeps an EMA of its acceptance rate (accepted / proposed per step); below
  `min_acceptance_rate` it stops speculating and is re-probed after `probe_interval` steps
  (input-grounded stretches come and go within one answer);
* a step with more than `disable_by_batch_size` running requests speculates for nobody;
* below that, drafts are budgeted per step (`plan_drafts`): on a CPU each verified row is
  real matmul work (and a draft model's guess costs a draft forward), so a draft is taken
  only while its expected gain (the chance it is accepted, from the request's EMA) raises
  the step's expected tokens per unit of cost. One stream gets long drafts; eight streams
  share a step whose fixed cost is already amortised, and get few or none.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from fornax.config import SpeculativeConfig
from fornax.engine.outputs import ModelRunnerOutput, SchedulerOutput
from fornax.engine.request import Request, RequestStatus
from fornax.spec_decode import Proposer

# One more verified row, relative to a decode step's fixed cost (measured: config.py).
DENSE_ROW_COST = 0.12
QUANTIZED_ROW_COST = 0.5


class SpecController:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, row_limit: int = 0) -> None:
        """row_limit: the most rows a step may have and still run the quantized small-step
        kernels (0: no such limit, a dense target); drafts never push a step past it (see
        plan_drafts). The default row cost follows the target's weights (config.py)."""
        self.config, self.proposer, self.row_limit = config, proposer, row_limit
        default_row_cost = QUANTIZED_ROW_COST if row_limit else DENSE_ROW_COST
        self.row_cost = default_row_cost if config.row_cost is None else config.row_cost

    def num_drafts(self, request: Request) -> int:
        """How many drafts this request may take now (0: it does not speculate this step)."""
        k = request.sampling_params.num_speculative_tokens
        k = self.config.num_speculative_tokens if k is None else min(k, self.config.num_speculative_tokens)
        # Only a decode speculates, and never past max_tokens (the target adds one token).
        if request.num_tokens - request.num_computed_tokens != 1:
            return 0
        return max(min(k, request.max_tokens - request.num_output_tokens - 1), 0)

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids on the running requests that speculate this step."""
        for request in running:
            request.spec_token_ids = []  # drafts live one step; leftovers of an unscheduled one go
        limit = self.config.disable_by_batch_size
        if limit and len(running) > limit:
            return
        candidates: list[Request] = []
        max_counts: list[int] = []
        for request in running:
            if request.status != RequestStatus.RUNNING:
                continue
            if request.spec.paused_steps > 0:
                request.spec.paused_steps -= 1
                continue
            k = self.num_drafts(request)
            if k > 0:
                candidates.append(request)
                max_counts.append(k)
        if not candidates:
            return
        draft_cost = self.config.draft_cost
        unit = self.row_cost + (self.proposer.cost_per_token if draft_cost is None else draft_cost)
        rates = [r.spec.acceptance_ema for r in candidates]
        # An explicit draft_cost replaces the proposer's own estimates, catch-up included.
        setup = None
        if draft_cost is None:
            setup = [self._amortized_setup(r, a) for r, a in zip(candidates, rates)]
        counts = plan_drafts(rates, max_counts, len(running), unit, self.row_cost, setup, self.row_limit)
        chosen = [(r, k) for r, k in zip(candidates, counts) if k > 0]
        if not chosen:
            return
        proposals = self.proposer.propose([r for r, _ in chosen], [k for _, k in chosen])
        for (request, _), drafts in zip(chosen, proposals):
            request.spec_token_ids = drafts

    def _amortized_setup(self, request: Request, rate: float) -> float:
        """The proposer's one-off setup cost spread over the steps the request has left.

        Starting to draft late (a request whose batch shrank near its end) rarely pays for
        a draft model's catch-up over the whole sequence; starting at the first decode does.
        """
        cost = self.proposer.setup_cost(request)
        if cost <= 0.0:
            return 0.0
        k = self.config.num_speculative_tokens
        per_step = sum(min(rate, 1.0) ** j for j in range(k + 1))  # expected tokens per step
        steps_left = max((request.max_tokens - request.num_output_tokens) / per_step, 1.0)
        return cost / steps_left

    def observe(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Update each verifying request's acceptance EMA; pause the ones that do not pay."""
        decay, floor = self.config.acceptance_ema_decay, self.config.min_acceptance_rate
        for item in sched.scheduled:
            tokens = result.spec_sampled.get(item.request.request_id)
            if tokens is None or not item.spec_token_ids:
                continue
            spec = item.request.spec
            rate = (len(tokens) - 1) / len(item.spec_token_ids)
            spec.acceptance_ema = decay * spec.acceptance_ema + (1.0 - decay) * rate
            if spec.acceptance_ema < floor:
                spec.paused_steps = self.config.probe_interval
                # Restart at the floor: one good probe resumes speculation, one bad re-pauses.
                spec.acceptance_ema = floor

    def drop(self, request_ids: Iterable[str]) -> None:
        self.proposer.drop(request_ids)


def plan_drafts(
    rates: list[float],
    max_counts: list[int],
    num_rows: int,
    unit: float,
    row_cost: float,
    setup: list[float] | None = None,
    row_limit: int = 0,
) -> list[int]:
    """How many drafts each request gets: greedy on expected gain per unit of cost.

    Costs are in units of a decode step's fixed cost (reading the weights once), so a plain
    step of `num_rows` rows costs 1 + row_cost * num_rows and yields num_rows tokens. Draft j
    of a request with per-token acceptance a is accepted with probability a**j and costs
    `unit`. Taking drafts best first while each one's gain/cost beats the step's current
    tokens/cost maximises the expected tokens per unit of cost. A request's first draft also
    carries its `setup` (e.g. a draft model's catch-up, amortised by the caller).

    A step of at most `row_limit` rows runs the quantized small-step kernels and a larger one
    the dense weights, several times dearer per step at that size: a cliff the linear cost
    does not see. So drafts stop where they would push a step that fits over the limit.
    """
    cost = 1.0 + row_cost * num_rows
    tokens = float(num_rows)
    room = row_limit - num_rows if row_limit and num_rows <= row_limit else -1  # -1: unbounded
    counts = [0] * len(rates)
    rates = [min(max(a, 0.0), 1.0) for a in rates]
    heap = [(-a, i, 1) for i, a in enumerate(rates) if max_counts[i] > 0]
    heapq.heapify(heap)
    while heap and room != 0:
        neg_gain, i, j = heapq.heappop(heap)
        gain = -neg_gain
        extra = setup[i] if setup is not None and j == 1 else 0.0
        if gain * cost <= (unit + extra) * tokens:
            if extra:
                continue  # this request's setup does not pay; cheaper ones still may
            break  # every draft left gains less: none pays
        counts[i] = j
        tokens += gain
        cost += unit + extra
        room -= 1 if room > 0 else 0
        if j < max_counts[i]:
            heapq.heappush(heap, (-(gain * rates[i]), i, j + 1))
    return counts
