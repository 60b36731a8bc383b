"""Which requests speculate this step, and how far: one acceptance model and one planner
around a Proposer.

Speculation must never make decoding much slower. Drafts that are rejected cost verify work
(and a draft model's forwards) for nothing, so:

* a step with more than `disable_by_batch_size` running requests speculates for nobody:
  past a few streams the step is compute-bound and the extra rows cost more than they bring;
* acceptance is learned per kind of proposal over all requests (`AcceptanceByKind`), and
  each request's own record of a kind shrinks its kind's rate towards what that request has
  shown. A `KindedProposer` (n-gram lookup) says what each proposal rests on (the length of
  the matched tail), and acceptance differs far more between kinds than between requests;
  any other proposer (a draft model) has one kind. No request is ever paused outright: a
  kind that stops being drafted drifts back towards the prior and is tried again, where
  pausing a request after a poor run lost the good matches that came next;
* the planner (`plan_by_step_costs`) gives a step the drafts, likeliest first, that maximise
  its expected tokens per second, on the whole-step costs by rows this engine has timed
  (`StepCosts`), and on a fitted line (`row_cost`, the kernel tiers) where it has none. One
  stream gets long drafts; eight share a step whose fixed cost is already amortised, and get
  few or none.

The measurements behind each choice and constant are in docs/speculative-decoding.md. The
per-request state is the controller's own (`_RequestRecord`, by request id): it is freed
when the request finishes, and Request carries only the drafts of the next step and the
counts its outputs report (SpecStats).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fornax.config import SpeculativeConfig
from fornax.engine.outputs import ModelRunnerOutput, SchedulerOutput
from fornax.engine.request import Request, RequestStatus
from fornax.engine.spec_decode import KindedProposer, Proposer, TargetInfo, build_proposer

# One more verified row, relative to a decode step's fixed cost: the fitted line's slope.
# Dense (and int8 x int8) steps read the weights once for every row; quantized small steps
# are compute-bound past one row, so a row costs more of their (cheaper) step.
DENSE_ROW_COST = 0.12
QUANTIZED_ROW_COST = 0.5
# No speculation in a step with more running requests than this: past it, drafted steps
# were measured slower than plain ones (the dense bf16 kernel's rows are nearly free up to
# four, then step up; quantized steps are compute-bound past one row).
DENSE_BATCH_LIMIT = 2
QUANTIZED_BATCH_LIMIT = 4
# What crossing from int4 one-row steps to int8 x int8 ones adds to a step, once (the int8
# weights are twice the int4 bytes); past it, each row costs the dense row cost.
TIER_STEP_COST = 0.3
# Per-kind acceptance forgets with this factor per observation, and per skipped proposal,
# so a kind that stopped paying drifts back towards the prior and is tried again (for
# n-gram's one-token matches, after ~200 skips).
KIND_DECAY = 0.98
# A request's own record of a kind counts against its kind's global rate as this many trials.
REQUEST_PRIOR = 2.0
# The one kind of a proposer that does not tell kinds apart (a draft model).
SINGLE_KIND = 0


@dataclass(frozen=True)
class TargetSteps:
    """What the target's decode steps run on, as far as the draft budget cares."""

    # Steps of at most this many rows run quantized small-step kernels (0: no such steps;
    # every step reads dense weights).
    quantized_max_rows: int = 0
    # The steps past that limit run int8 x int8 (else the dense weights, several times dearer).
    int8_large_steps: bool = False

    @classmethod
    def of(cls, target: TargetInfo) -> TargetSteps:
        """From the loaded target's weight forms ("auto" on a model without quantized tensors
        leaves every step dense: no limit then)."""
        model = target.loaded.model
        quantized = target.small_step_max_rows if model.has_quantized_small_steps() else 0
        return cls(quantized, model.has_int8_large_steps())


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


@dataclass
class _RequestRecord:
    """What the controller remembers of one live request that has drafted."""

    # Its own geometric record per kind: [accepted drafts, rejections] (AcceptanceByKind.rate_for).
    kind_counts: dict[int, list[float]] = field(default_factory=dict)
    draft_kind: int = SINGLE_KIND  # what this step's drafts rest on


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
        self, config: SpeculativeConfig, proposer: Proposer, steps: TargetSteps | None = None
    ) -> None:
        """`steps`: what the target's steps run on (None: dense weights throughout). It sets
        the fitted line's defaults and where a step's drafts stop or pay a step up: a step of
        at most `row_limit` rows runs the quantized small-step kernels, and crossing that
        limit adds `cliff` (inf: never cross; see _prior_units)."""
        steps = TargetSteps() if steps is None else steps
        self.config, self.proposer = config, proposer
        self.row_limit = steps.quantized_max_rows
        self.cliff = TIER_STEP_COST if steps.int8_large_steps else math.inf
        # Past a finite cliff the larger steps' kernels are dense-like: the dense row cost.
        default_row_cost = QUANTIZED_ROW_COST if self.row_limit and math.isinf(self.cliff) else DENSE_ROW_COST
        self.row_cost = default_row_cost if config.row_cost is None else config.row_cost
        default_limit = QUANTIZED_BATCH_LIMIT if self.row_limit else DENSE_BATCH_LIMIT
        limit = config.disable_by_batch_size
        self.batch_limit = default_limit if limit is None else limit
        # Measured step costs replace the fitted line unless the caller fixed row_cost.
        self.step_costs = StepCosts() if config.row_cost is None else None
        # Checked once: isinstance against a runtime Protocol walks its attributes (~25 us).
        self.kinded = proposer if isinstance(proposer, KindedProposer) else None
        self.kinds = AcceptanceByKind()
        self.records: dict[str, _RequestRecord] = {}  # request id -> its record, while it lives

    @classmethod
    def for_target(cls, config: SpeculativeConfig, target: TargetInfo) -> SpecController:
        """The controller and its proposer for the engine `target` describes."""
        return cls(config, build_proposer(config, target), TargetSteps.of(target))

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
            k = self.num_drafts(request) if request.status == RequestStatus.RUNNING else 0
            if k > 0:
                candidates.append(request)
                max_counts.append(k)
        lookups: list[list[int]] | None = None
        if self.kinded is not None and candidates:
            # A lookup is nearly free: find each request's full drafts and their kind first,
            # then budget each proposal by its own kind's rate.
            proposals = self.kinded.propose_with_kinds(candidates, max_counts)
            found = [
                (request, drafts, kind) for request, (drafts, kind) in zip(candidates, proposals) if drafts
            ]
            candidates = [request for request, _, _ in found]
            lookups = [drafts for _, drafts, _ in found]
            kinds = [kind for _, _, kind in found]
            max_counts = [len(drafts) for drafts in lookups]
        else:
            kinds = [SINGLE_KIND] * len(candidates)
        if not candidates:
            return
        rates = [self.kinds.rate_for(self._counts_of(r), kind) for r, kind in zip(candidates, kinds)]
        draft_cost = self.config.draft_cost
        unit = self.row_cost + (self.proposer.cost_per_token if draft_cost is None else draft_cost)
        # An explicit draft_cost replaces the proposer's own estimates, catch-up included.
        setup = None
        if draft_cost is None:
            setup = [self._amortized_setup(r, a) for r, a in zip(candidates, rates)]
        counts = self._plan(rates, max_counts, len(running), unit, setup)
        drafted = [i for i, k in enumerate(counts) if k > 0]
        for i, k in enumerate(counts):
            if k == 0:
                self.kinds.skipped(kinds[i])
        if not drafted:
            return
        if lookups is None:  # a draft model guesses only what was budgeted: each guess is a forward
            guesses = self.proposer.propose([candidates[i] for i in drafted], [counts[i] for i in drafted])
        else:
            guesses = [lookups[i][: counts[i]] for i in drafted]
        for i, drafts in zip(drafted, guesses):
            request = candidates[i]
            request.spec_token_ids = drafts
            record = self.records.get(request.request_id)
            if record is None:
                record = self.records[request.request_id] = _RequestRecord()
            record.draft_kind = kinds[i]

    def _counts_of(self, request: Request) -> dict[int, list[float]]:
        record = self.records.get(request.request_id)
        return record.kind_counts if record is not None else {}

    def _plan(
        self, rates: list[float], max_counts: list[int], num_rows: int, unit: float, setup: list[float] | None
    ) -> list[int]:
        """Drafts per candidate. Costs come from the steps this engine has timed where it has
        them, and from the fitted line (`row_cost`, the cliff) scaled to them where not; with
        no timed step of `num_rows` rows yet, from the line alone, in its own units.

        The line is only a prior: the native kernels' cost by rows is a staircase (dense
        bf16 takes a few rows for nearly the price of one, then steps up), and a verify step
        also pays the sampler's and the bookkeeping's share. A row count the prior makes
        look good gets tried, timed, and from then on planned on as measured.
        """
        costs = self.step_costs
        base = costs.seconds_at(num_rows) if costs is not None else None
        measured = costs if base is not None else None
        # Seconds per unit of the line, now (1: the plan stays in the line's units).
        scale = 1.0 if base is None else base / self._prior_units(num_rows, num_rows)

        def seconds(rows: int) -> float:
            timed = measured.seconds_at(rows) if measured is not None else None
            return timed if timed is not None else self._prior_units(num_rows, rows) * scale

        fits = self.row_limit > 0 and num_rows <= self.row_limit
        room = self.row_limit - num_rows if fits and math.isinf(self.cliff) else -1
        # A draft's own cost beyond its row (a draft model's forward; nothing for n-gram).
        per_draft = (unit - self.row_cost) * scale
        setup_seconds = None if setup is None else [x * scale for x in setup]
        return plan_by_step_costs(rates, max_counts, num_rows, seconds, per_draft, setup_seconds, room)

    def _prior_units(self, num_rows: int, rows: int) -> float:
        """The fitted line: a step of `rows` rows, when the step without drafts has num_rows,
        in units of a decode step's fixed cost (reading the weights once)."""
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
        """Learn from each verify, for its kind over all requests and in the request's own
        record; forget the requests this step finished."""
        for item in sched.scheduled:
            request = item.request
            rid = request.request_id
            record = self.records.pop(rid, None) if request.is_finished else self.records.get(rid)
            tokens = result.spec_sampled.get(rid)
            if tokens is None or not item.spec_token_ids:
                continue
            kind = record.draft_kind if record is not None else SINGLE_KIND
            drafts, accepted = len(item.spec_token_ids), len(tokens) - 1
            self.kinds.observe(kind, drafts, accepted)
            if record is not None and not request.is_finished:
                add_verify(record.kind_counts.setdefault(kind, [0.0, 0.0]), drafts, accepted)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished (and aborted) requests, here and in the proposer."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self.records.pop(rid, None)
        self.proposer.drop(request_ids)


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
