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

A cheap proposer that says what each proposal rests on (a `KindedProposer`: n-gram lookup
and its matched length) is asked first, and each proposal is budgeted by the acceptance
learned for its kind over all requests (`AcceptanceByKind`) instead of by the request's EMA:
measured on the spec benchmark's prompts, an n-gram matched on one token was accepted
14-18% of the time and one matched on two to four 53-86%, in open-ended and input-grounded
answers alike. Pausing a request after a poor run lost the good matches that came next.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable

from fornax.config import SpeculativeConfig
from fornax.engine.outputs import ModelRunnerOutput, SchedulerOutput
from fornax.engine.request import Request, RequestStatus
from fornax.spec_decode import KindedProposer, Proposer

# One more verified row, relative to a decode step's fixed cost (measured: config.py).
DENSE_ROW_COST = 0.12
QUANTIZED_ROW_COST = 0.5
# No speculation in a step with more running requests than this (measured: config.py).
DENSE_BATCH_LIMIT = 2
QUANTIZED_BATCH_LIMIT = 4
# A lone request's step with int4 one-row steps and int8 x int8 past them (make run's
# weights): timed whole engine steps by rows (4 x 16 prompts x 96 tokens, n-gram drafting
# always; 2026-12-04): 5.2 ms at one row, 7.1 at two, 8.8 at five, 11.5 at nine. Past one
# row the slope is the dense row cost (0.12 of the fixed cost); the step from one row to two
# adds 0.3 more, once: the int8 weights are twice the int4 bytes.
TIER_STEP_COST = 0.3
# Per-kind acceptance forgets with this factor per observation, and per skipped proposal,
# so a kind that stopped paying drifts back towards the prior and is tried again (for
# n-gram's one-token matches, after ~200 skips).
KIND_DECAY = 0.98
# A request's own record of a kind counts against its kind's global rate as this many trials.
REQUEST_PRIOR = 2.0


def add_verify(counts: list[float], drafts: int, accepted: int, decay: float = 1.0) -> None:
    """Fold one verify into geometric [successes, failures] counts, decaying the old ones:
    `accepted` of `drafts` survived, and a rejection ended the run if accepted < drafts."""
    counts[0] = counts[0] * decay + accepted
    counts[1] = counts[1] * decay + (1.0 if accepted < drafts else 0.0)


class AcceptanceByKind:
    """Per-draft acceptance rate of each kind of proposal, learned over all requests.

    Acceptance is modelled as geometric (draft j survives with probability a**j): a verify
    of d drafts that accepted A is A successes and, if A < d, one failure. The rate is the
    decayed successes over the decayed trials, with a prior of one of each (0.5).
    """

    def __init__(self, decay: float = KIND_DECAY) -> None:
        self.decay = decay
        self.counts: dict[int, list[float]] = {}  # kind -> [accepted, rejected]

    def rate(self, kind: int) -> float:
        accepted, rejected = self.counts.get(kind, (0.0, 0.0))
        return (1.0 + accepted) / (2.0 + accepted + rejected)

    def observe(self, kind: int, drafts: int, accepted: int) -> None:
        add_verify(self.counts.setdefault(kind, [0.0, 0.0]), drafts, accepted, self.decay)

    def skipped(self, kind: int) -> None:
        counts = self.counts.get(kind)
        if counts is not None:
            counts[0] *= self.decay
            counts[1] *= self.decay

    def rate_for(self, request_counts: dict[int, list[float]], kind: int) -> float:
        """The kind's rate for one request: the request's own record of that kind, shrunk
        towards the kind's rate over all requests with the weight of REQUEST_PRIOR trials.
        Kinds tell most, but not all: a long match in a request that summarises fails where
        the same match in one that copies succeeds, and two failures in a request should
        count for more than hundreds elsewhere."""
        accepted, rejected = request_counts.get(kind, (0.0, 0.0))
        return (REQUEST_PRIOR * self.rate(kind) + accepted) / (REQUEST_PRIOR + accepted + rejected)


class StepCosts:
    """Seconds of whole decode-only engine steps, by their number of rows, as this engine
    measured them: what the draft budget plans on where it has them (see _plan).

    A row count is trusted from MIN_SAMPLES steps on, and its figure is the median of the
    last WINDOW: one hiccup of a shared machine must not stop a row count being chosen. A
    count not timed again for MAX_AGE steps is forgotten: one timed during a burst of outside
    load and never chosen since would otherwise never be re-timed.
    """

    WINDOW = 9
    MIN_SAMPLES = 3
    MAX_AGE = 2000  # steps: ~10-20 s of decoding here

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}
        self._last_seen: dict[int, int] = {}
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._steps += 1
        self._last_seen[rows] = self._steps
        samples = self._samples.setdefault(rows, deque(maxlen=self.WINDOW))
        samples.append(seconds)
        if len(samples) >= self.MIN_SAMPLES:
            self._median[rows] = statistics.median(samples)

    def seconds_at(self, rows: int) -> float | None:
        median = self._median.get(rows)
        if median is not None and self._steps - self._last_seen[rows] > self.MAX_AGE:
            del self._median[rows], self._samples[rows], self._last_seen[rows]
            return None
        return median


class SpecController:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, row_limit: int = 0, cliff: float = math.inf
    ) -> None:
        """row_limit: the most rows a step may have and still run the quantized small-step
        kernels (0: no such limit, a dense target); `cliff`: what crossing it adds to a step
        (inf: never cross; see plan_drafts). The default row cost follows the target's
        weights (config.py): past a finite cliff the larger steps' kernels are dense-like."""
        self.config, self.proposer, self.row_limit, self.cliff = config, proposer, row_limit, cliff
        default_row_cost = QUANTIZED_ROW_COST if row_limit and math.isinf(cliff) else DENSE_ROW_COST
        self.row_cost = default_row_cost if config.row_cost is None else config.row_cost
        default_limit = QUANTIZED_BATCH_LIMIT if row_limit else DENSE_BATCH_LIMIT
        limit = config.disable_by_batch_size
        self.batch_limit = default_limit if limit is None else limit
        # Measured step costs replace the fitted line unless the caller fixed row_cost.
        self.step_costs = StepCosts() if config.row_cost is None else None
        # Checked once: isinstance against a runtime Protocol walks its attributes (~25 us).
        self.kinded = proposer if isinstance(proposer, KindedProposer) else None
        self.kinds = AcceptanceByKind() if self.kinded is not None else None

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
        limit = self.batch_limit
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
        if self.kinds is not None:
            self._propose_by_kind(candidates, max_counts, len(running))
            return
        draft_cost = self.config.draft_cost
        unit = self.row_cost + (self.proposer.cost_per_token if draft_cost is None else draft_cost)
        rates = [r.spec.acceptance_ema for r in candidates]
        # An explicit draft_cost replaces the proposer's own estimates, catch-up included.
        setup = None
        if draft_cost is None:
            setup = [self._amortized_setup(r, a) for r, a in zip(candidates, rates)]
        counts = self._plan(rates, max_counts, len(running), unit, setup)
        chosen = [(r, k) for r, k in zip(candidates, counts) if k > 0]
        if not chosen:
            return
        proposals = self.proposer.propose([r for r, _ in chosen], [k for _, k in chosen])
        for (request, _), drafts in zip(chosen, proposals):
            request.spec_token_ids = drafts

    def _propose_by_kind(self, candidates: list[Request], max_counts: list[int], num_rows: int) -> None:
        """Look up full drafts first (nearly free), then budget each by its kind's rate."""
        assert self.kinds is not None and self.kinded is not None
        proposals = self.kinded.propose_with_kinds(candidates, max_counts)
        found = [(r, drafts, kind) for r, (drafts, kind) in zip(candidates, proposals) if drafts]
        if not found:
            return
        rates = [self.kinds.rate_for(r.spec.kind_counts, kind) for r, _, kind in found]
        unit = self.row_cost + (self.config.draft_cost or 0.0)
        counts = self._plan(rates, [len(d) for _, d, _ in found], num_rows, unit, None)
        for (request, drafts, kind), k in zip(found, counts):
            if k > 0:
                request.spec_token_ids = drafts[:k]
                request.spec.draft_kind = kind
            else:
                self.kinds.skipped(kind)

    def _plan(
        self, rates: list[float], max_counts: list[int], num_rows: int, unit: float, setup: list[float] | None
    ) -> list[int]:
        """Drafts per candidate. Costs come from the steps this engine has timed where it has
        them, and from the fitted line (`row_cost`, the cliff) scaled to them where not.

        The line is only a prior: the native kernels' cost by rows is a staircase (dense
        bf16 takes one to four rows for nearly the price of one, then steps up by half), and
        a verify step also pays the sampler's and the bookkeeping's share. A row count the
        prior makes look good gets tried, timed, and from then on planned on as measured.
        """
        base = self.step_costs.seconds_at(num_rows) if self.step_costs is not None else None
        if base is None:
            return plan_drafts(
                rates, max_counts, num_rows, unit, self.row_cost, setup, self.row_limit, self.cliff
            )
        assert self.step_costs is not None
        scale = base / self._prior_units(num_rows, num_rows)  # seconds per prior unit, now
        costs = self.step_costs

        def seconds(rows: int) -> float:
            measured = costs.seconds_at(rows)
            return measured if measured is not None else self._prior_units(num_rows, rows) * scale

        fits = self.row_limit > 0 and num_rows <= self.row_limit
        room = self.row_limit - num_rows if fits and math.isinf(self.cliff) else -1
        # A draft's own cost beyond its row (a draft model's forward; nothing for n-gram).
        per_draft = (unit - self.row_cost) * scale
        setup_seconds = None if setup is None else [x * scale for x in setup]
        return plan_by_step_costs(rates, max_counts, num_rows, seconds, per_draft, setup_seconds, room)

    def _prior_units(self, num_rows: int, rows: int) -> float:
        """The fitted line: a step of `rows` rows, when the step without drafts has num_rows."""
        units = 1.0 + self.row_cost * rows
        if self.row_limit and num_rows <= self.row_limit < rows and not math.isinf(self.cliff):
            units += self.cliff
        return units

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """Time a whole engine step; only all-decode steps (with or without drafts) count."""
        if self.step_costs is None or not sched.scheduled:
            return
        if all(item.num_new_tokens == 1 + len(item.spec_token_ids) for item in sched.scheduled):
            self.step_costs.observe(sched.num_batched_tokens, seconds)

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
            if self.kinds is not None:  # budgeted by kind: no per-request pause
                drafts, accepted = len(item.spec_token_ids), len(tokens) - 1
                self.kinds.observe(spec.draft_kind, drafts, accepted)
                add_verify(spec.kind_counts.setdefault(spec.draft_kind, [0.0, 0.0]), drafts, accepted)
                continue
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
    cliff: float = math.inf,
) -> list[int]:
    """How many drafts each request gets: greedy on expected gain per unit of cost.

    Costs are in units of a decode step's fixed cost (reading the weights once), so a plain
    step of `num_rows` rows costs 1 + row_cost * num_rows and yields num_rows tokens. Draft j
    of a request with per-token acceptance a is accepted with probability a**j and costs
    `unit`. Taking drafts best first while each one's gain/cost beats the step's current
    tokens/cost maximises the expected tokens per unit of cost. A request's first draft also
    carries its `setup` (e.g. a draft model's catch-up, amortised by the caller).

    A step of at most `row_limit` rows runs the quantized small-step kernels and a larger one
    other kernels, dearer per step at that size by `cliff`: a jump the linear cost does not
    see. An infinite cliff (dense weights past the limit, several times dearer) is never
    crossed; a finite one (int8 x int8 past int4's one row) is crossed when the drafts that
    cross it pay for it too: both plans are made and the better tokens per cost wins.
    """
    cost = 1.0 + row_cost * num_rows
    fits = row_limit > 0 and num_rows <= row_limit
    below = _greedy(
        rates, max_counts, cost, float(num_rows), unit, setup, row_limit - num_rows if fits else -1
    )
    if not fits or math.isinf(cliff):
        return below[0]
    across = _greedy(rates, max_counts, cost + cliff, float(num_rows), unit, setup, -1)
    if sum(across[0]) <= row_limit - num_rows:
        return below[0]  # the plan across never actually crosses: the one below is it, costed right
    best = max((below, across), key=lambda plan: plan[1] / plan[2])
    return best[0]


def _greedy(
    rates: list[float],
    max_counts: list[int],
    cost: float,
    tokens: float,
    unit: float,
    setup: list[float] | None,
    room: int,
) -> tuple[list[int], float, float]:
    """plan_drafts' greedy pass from a step of `cost` and `tokens`, with at most `room` drafts
    (-1: unbounded). Returns the counts and the plan's expected tokens and cost."""
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
    return counts, tokens, cost


def plan_by_step_costs(
    rates: list[float],
    max_counts: list[int],
    num_rows: int,
    seconds: Callable[[int], float],
    per_draft: float = 0.0,
    setup: list[float] | None = None,
    room: int = -1,
) -> list[int]:
    """Drafts per request that maximise expected tokens per second, for a step-cost curve.

    `seconds(rows)` is what a step of that many rows costs. Whatever the total number of
    drafts m, the best m are the m likeliest (draft j of a request with acceptance a gains
    a**j, and a request's drafts come in order), so trying every m is exact for the curve,
    steps and all, where a greedy walk along a line stops at the first step up. Each draft
    also costs `per_draft` and a request's first one its `setup` (seconds); at most `room`
    drafts in all (-1: no bound).
    """
    rates = [min(max(a, 0.0), 1.0) for a in rates]
    heap = [(-a, i, 1) for i, a in enumerate(rates) if max_counts[i] > 0]
    heapq.heapify(heap)
    order: list[tuple[int, int]] = []  # (request, draft number), likeliest first
    gains: list[float] = []
    while heap and len(order) != room:
        neg_gain, i, j = heapq.heappop(heap)
        order.append((i, j))
        gains.append(-neg_gain)
        if j < max_counts[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i, j + 1))
    best_m, best = 0, num_rows / seconds(num_rows)
    tokens, extra = float(num_rows), 0.0
    for m, ((i, j), gain) in enumerate(zip(order, gains), start=1):
        tokens += gain
        extra += per_draft + (setup[i] if setup is not None and j == 1 else 0.0)
        rate = tokens / (seconds(num_rows + m) + extra)
        if rate > best:
            best_m, best = m, rate
    counts = [0] * len(rates)
    for i, j in order[:best_m]:
        counts[i] = j
    return counts
