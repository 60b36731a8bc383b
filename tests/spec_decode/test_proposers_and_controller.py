"""Speculative decoding, pure parts: config validation, n-gram lookup, the scheduler's
accept/rollback bookkeeping (against a fake runner with a simulated KV cache), the adaptive
rule, and the rejection sampler's distribution."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fornax.config import ConfigError, SpeculativeConfig
from fornax.engine.kv.manager import cdiv
from fornax.engine.outputs import ModelRunnerOutput, SchedulerOutput
from fornax.engine.request import Request, SamplingParams, SamplingParamsError
from fornax.engine.sample.rejection import verify_drafts
from fornax.engine.scheduler import Scheduler
from fornax.engine.spec_decode.controller import SINGLE_KIND, SpecController, TargetSteps
from fornax.engine.spec_decode.ngram import NgramProposer, lookup
from tests.unit.test_scheduler import FakeRunner, make, req

# -- config --


def test_config_from_dict_and_json():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    cfg = SpeculativeConfig.from_dict(text)
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5)
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict({"method": "self", "draft_layers": 4}).draft_layers == 4


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "ngram", "k": 2}, "unknown speculative config key"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
        ({"method": "draft"}, "needs 'model'"),
        ({"method": "ngram", "model": "x"}, "only applies to method 'draft'"),
        ({"method": "ngram", "draft_layers": 2}, "only apply to method 'self'"),
        ({"method": "self"}, "needs 'draft_layers' and/or 'quantization'"),
        ({"method": "self", "quantization": "int3"}, "quantization must be"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_config_errors_are_clear(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(value)


@pytest.mark.parametrize("key", ["min_acceptance_rate", "acceptance_ema_decay", "probe_interval"])
def test_a_removed_knob_is_an_error_that_names_it(key):
    """The per-request acceptance EMA's knobs: given by a user (a dict or --speculative-config
    JSON), each is refused by name, never silently ignored."""
    for value in ({"method": "ngram", key: 1}, json.dumps({"method": "ngram", key: 1})):
        with pytest.raises(ConfigError, match=rf"\['{key}'\] were removed") as info:
            SpeculativeConfig.from_dict(value)
        assert "unknown" not in str(info.value)


def test_per_request_num_speculative_tokens_is_validated():
    assert SamplingParams(num_speculative_tokens=0).num_speculative_tokens == 0
    with pytest.raises(SamplingParamsError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


# -- n-gram lookup --


def test_ngram_prefers_the_longest_tail_then_the_latest_full_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # tail [7, 2, 3] never occurred; [2, 3] occurred at 1 and 6: the latest with 2 tokens after wins.
    assert lookup(tokens, 2, 1, 3) == [4, 5]
    # Asking for 6: only the earlier occurrence has 6 tokens after it.
    assert lookup(tokens, 6, 1, 3) == [9, 9, 1, 2, 3, 4]
    # Asking for 11: none has, so the latest gives what there is.
    assert lookup(tokens, 11, 1, 3) == [4, 5, 7, 2, 3]
    assert lookup([1, 2, 3], 3, 1, 3) == []  # nothing repeats
    assert lookup([4], 2, 1, 3) == []
    assert lookup([5, 5, 5, 5], 2, 2, 2) == [5, 5]


def _lookup_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The lookup's definition, spelled out slowly."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        afters = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        if afters:
            full = [a for a in afters if a + k <= len(tokens)]
            start = full[-1] if full else afters[-1]
            return tokens[start : start + k], n
    return [], 0


def test_ngram_lookup_matches_its_definition_on_random_sequences():
    import random

    from fornax.engine.spec_decode.ngram import lookup_with_length

    rng = random.Random(0)
    matched = 0
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 4, 30])) for _ in range(rng.randrange(1, 60))]
        k, min_n = rng.randrange(1, 7), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        got = lookup_with_length(tokens, k, min_n, max_n)
        assert got == _lookup_reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        matched += got[1] > 0
    assert 500 < matched < 1900  # both outcomes were exercised


# -- scheduler bookkeeping with drafts --


class FakeSpecRunner(FakeRunner):
    """FakeRunner plus verification: writes drafts into the cache like real tokens, and accepts
    draft j while it equals what the fake model would sample after the drafts before it."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        plain = [s for s in out.scheduled if not s.spec_token_ids]
        result = super().execute(SchedulerOutput(plain, 0)) if plain else ModelRunnerOutput(sampled={})
        pool = self.scheduler.kv.pool
        for s in out.scheduled:
            if not s.spec_token_ids:
                continue
            r, start, end = s.request, s.start, s.start + s.num_new_tokens
            assert len(s.block_ids) == cdiv(end, self.bs)
            context = [self.slots[(s.block_ids[t // self.bs], t % self.bs)] for t in range(start)]
            assert context == r.all_token_ids[:start], f"{r.request_id}: KV cache holds the wrong tokens"
            seq = context + r.all_token_ids[start:] + s.spec_token_ids
            for t in range(start, end):
                assert pool.blocks[s.block_ids[t // self.bs]].ref_cnt == 1, "writing into a shared block"
                self.slots[(s.block_ids[t // self.bs], t % self.bs)] = seq[t]
            accepted: list[int] = []
            for j, draft in enumerate(s.spec_token_ids + [None]):
                truth = fake_next(seq[: r.num_tokens + j])
                accepted.append(truth)
                if draft != truth:
                    break
            result.spec_sampled[r.request_id] = accepted
        return result


def make_spec(**kw: object) -> tuple[Scheduler, FakeSpecRunner]:
    sched, _ = make(**kw)
    return sched, FakeSpecRunner(sched)


def fake_next(seq: list[int]) -> int:
    return sum((t + 1) * tok for t, tok in enumerate(seq)) * 31 % 97


def oracle_drafts(request: Request, k: int, wrong_at: int | None) -> list[int]:
    seq = list(request.all_token_ids)
    drafts = []
    for j in range(k):
        token = fake_next(seq)
        if j == wrong_at:
            token = (token + 1) % 97
        drafts.append(token)
        seq.append(token)
    return drafts


def _run(sched: Scheduler, runner: FakeRunner, k: int, step_no: list[int]) -> None:
    while sched.has_unfinished_requests():
        step_no[0] += 1
        for r in sched.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                r.spec_token_ids = oracle_drafts(r, k, wrong_at=step_no[0] % (k + 2))
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        sched.update_from_output(out, runner.execute(out))
        sched.kv.check_integrity()
        for r in sched.running:  # rollback leaves exactly the blocks the computed tokens need
            assert len(sched.kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, sched.block_size)
            assert r.num_computed_tokens == r.num_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens
        assert step_no[0] < 10_000


@pytest.mark.parametrize("num_blocks", [256, 14])  # 14: preemptions happen
def test_scheduler_accepts_rolls_back_and_matches_plain_decoding(num_blocks):
    def requests() -> list[Request]:
        return [req(f"r{i}", 5 + 7 * i, max_tokens=20 + i) for i in range(6)]

    plain_sched, plain_runner = make_spec(num_blocks=num_blocks, block_size=4, budget=64)
    plain = requests()
    for r in plain:
        plain_sched.add_request(r)
    _run(plain_sched, plain_runner, 0, [0])
    sched, runner = make_spec(num_blocks=num_blocks, block_size=4, budget=64)
    spec = requests()
    for r in spec:
        sched.add_request(r)
    _run(sched, runner, 3, [0])
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.num_output_tokens == r.max_tokens for r in spec)  # never past max_tokens
    assert sched.spec_num_accepted_tokens_total > 0
    assert sched.spec_num_draft_tokens_total > sched.spec_num_accepted_tokens_total  # some rejected
    assert sched.kv.num_free_blocks == num_blocks
    if num_blocks == 14:
        assert sched.num_preemptions_total > 0


def test_prefix_cache_holds_only_accepted_tokens():
    """A later request whose prompt is an earlier one's prompt + output hits its cached blocks;
    the fake runner checks every hit block holds exactly those tokens, not stale drafts."""
    sched, runner = make_spec(block_size=4)
    first = req("a", 9, max_tokens=30)
    sched.add_request(first)
    _run(sched, runner, 4, [0])
    second = req("b", first.all_token_ids[:-1], max_tokens=3)
    sched.add_request(second)
    _run(sched, runner, 0, [0])
    assert second.num_cached_tokens >= 32


def test_drafts_are_capped_by_the_budget_and_dropped_before_anyone_is_preempted():
    sched, runner = make_spec(num_blocks=3, block_size=4, budget=3)
    r = req("a", 3, max_tokens=8)
    sched.add_request(r)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))  # prefill
    r.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [1, 2]  # the budget of 3 leaves room for 2 drafts
    assert r.spec_token_ids == []  # drafts live for one step only
    sched.update_from_output(out, runner.execute(out))
    sched.kv.check_integrity()

    sched, runner = make_spec(num_blocks=2, block_size=4, budget=8)
    r = req("b", 7, max_tokens=2)
    sched.add_request(r)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))  # 7 tokens: both blocks
    r.spec_token_ids = [1]  # position 8 would need a third block
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].spec_token_ids == []
    assert not out.preempted_request_ids


# -- the adaptive rule --


class RepeatProposer:
    """A proposer without kinds (like a draft model): always guesses the last token again."""

    cost_per_token = 0.0

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [[r.all_token_ids[-1]] * k for r, k in zip(requests, num_tokens)]

    def setup_cost(self, request: Request) -> float:
        return 0.0

    def drop(self, request_ids: object) -> None:
        pass


def _spec_steps(
    controller: SpecController, sched: Scheduler, runner: FakeSpecRunner, steps: int
) -> list[bool]:
    out_steps = []
    for _ in range(steps):
        controller.propose(sched.running)
        out = sched.schedule()
        result = runner.execute(out)
        sched.update_from_output(out, result)
        controller.observe(out, result)
        out_steps.append(bool(out.scheduled[0].spec_token_ids))
    return out_steps


def test_a_proposer_without_kinds_stops_drafting_where_drafts_fail_and_tries_again_later():
    """A draft model's proposals are one kind: its rate is learned over all requests and
    shrunk towards the request's own record. Failing drafts stop being budgeted (no pause
    counter), and the unused chances let the rate drift back until the request is tried again."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2, row_cost=0.12)
    sched, runner = make_spec(block_size=4)
    controller = SpecController(cfg, RepeatProposer())
    assert controller.kinded is None  # one kind: the budget asks for exactly what it plans
    sched.add_request(req("a", [7, 8, 7, 8, 7, 8, 7], max_tokens=80))  # the fake model does not repeat
    spec_steps = _spec_steps(controller, sched, runner, 20)  # (for its first 30 tokens)
    assert spec_steps[0] is False  # the prefill step
    first_off = spec_steps.index(False, 1)
    assert first_off > 1 and all(spec_steps[1:first_off]) and not any(spec_steps[first_off:]), spec_steps
    record = controller.records["a"]  # the request's own record lives on the controller
    assert record.kind_counts[SINGLE_KIND] == [0.0, first_off - 1]  # every verify: a rejection
    assert controller.kinds.rate_for(record.kind_counts, SINGLE_KIND) < controller.kinds.rate(SINGLE_KIND)
    # Each skipped chance fades the evidence over all requests: the request is tried again.
    assert True in _spec_steps(controller, sched, runner, 20)


def _decoding(request_id: str, tokens: list[int]) -> Request:
    r = req(request_id, tokens, max_tokens=40)
    r.status = r.status.RUNNING
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_ngram_drafts_are_budgeted_by_the_kind_of_match():
    """Each proposal is budgeted by the rate learned for its kind (the matched length); a
    kind that keeps failing stops being drafted without pausing anyone."""
    from types import SimpleNamespace

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    make_run = TargetSteps(quantized_max_rows=1, int8_large_steps=True)  # int4 one row, then int8 x int8
    controller = SpecController(cfg, NgramProposer(cfg), make_run)
    assert controller.kinded is not None
    long_match = _decoding("a", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4])  # tail matched on 4 tokens
    short_match = _decoding("b", [9, 5, 6, 7, 8, 5])  # on 1 token
    controller.propose([long_match])
    # The prior (0.5) pays for two drafts across the cliff; a third would gain 0.125 for 0.12.
    assert long_match.spec_token_ids == [5, 6] and controller.records["a"].draft_kind == 4
    # The target rejects the first draft again and again: kind 4 learns it and stops.
    for _ in range(8):
        controller.propose([long_match])
        if not long_match.spec_token_ids:
            break
        item = SimpleNamespace(request=long_match, spec_token_ids=long_match.spec_token_ids)
        controller.observe(SimpleNamespace(scheduled=[item]), SimpleNamespace(spec_sampled={"a": [99]}))
    assert long_match.spec_token_ids == [] and controller.kinds.rate(4) < 0.4  # one failure does it here
    assert controller.records["a"].kind_counts[4][1] > 0  # its own record holds the failures
    controller.kinds.counts[1] = [40.0, 2.0]  # one-token matches have been accepted 95% of the time
    controller.propose([long_match, short_match])
    assert long_match.spec_token_ids == [] and short_match.spec_token_ids == [6, 7, 8]
    assert controller.records["b"].draft_kind == 1


def test_acceptance_by_kind_learns_and_forgets():
    from fornax.engine.spec_decode.controller import AcceptanceByKind

    kinds = AcceptanceByKind(decay=0.9)
    assert kinds.rate(3) == 0.5
    for _ in range(30):
        kinds.observe(3, drafts=4, accepted=4)  # all accepted: successes, no failure
        kinds.observe(1, drafts=4, accepted=0)  # the first rejected: one failure
    assert kinds.rate(3) > 0.95 and kinds.rate(1) < 0.15
    # Geometric: 3 of 4 accepted then a rejection is 3 successes and 1 failure.
    one = AcceptanceByKind(decay=1.0)
    one.observe(2, drafts=4, accepted=3)
    assert one.rate(2) == (1 + 3) / (2 + 4)
    low = kinds.rate(1)
    for _ in range(100):
        kinds.skipped(1)  # unused chances fade the evidence: the rate drifts back to the prior
    assert low < kinds.rate(1) < 0.5 and abs(kinds.rate(1) - 0.5) < 0.01


def test_no_speculation_in_large_batches():
    cfg = SpeculativeConfig(method="ngram", disable_by_batch_size=2)
    controller = SpecController(cfg, NgramProposer(cfg))
    running = [req(f"r{i}", [1, 2, 1, 2, 1], max_tokens=10) for i in range(3)]
    for r in running:
        r.status = r.status.RUNNING
        r.num_computed_tokens = r.num_tokens - 1
    controller.propose(running)
    assert all(r.spec_token_ids == [] for r in running)
    controller.propose(running[:2])
    assert all(r.spec_token_ids for r in running[:2])
    # Unset, the limit follows the target's weights: dense 2, quantized small steps 4.
    ngram = SpeculativeConfig(method="ngram")
    assert SpecController(ngram, NgramProposer(ngram)).batch_limit == 2
    assert SpecController(ngram, NgramProposer(ngram), TargetSteps(1, int8_large_steps=True)).batch_limit == 4


def test_budget_on_measured_step_costs_sees_the_staircase():
    from fornax.engine.spec_decode.controller import plan_by_step_costs

    # The dense bf16 kernel: one to four rows for nearly the price of one, then a step up.
    stairs = {1: 10.0, 2: 10.3, 3: 10.6, 4: 11.0, 5: 15.5, 6: 16.0, 7: 16.5, 8: 22.0}
    assert plan_by_step_costs([0.7], [4], 1, stairs.__getitem__) == [3]  # stops below the step
    assert plan_by_step_costs([0.99], [4], 1, stairs.__getitem__) == [3]  # even near-certain ones
    low_step = stairs | {5: 12.0}
    assert plan_by_step_costs([0.99], [4], 1, low_step.__getitem__) == [4]  # a low step is climbed
    line = {r: 10.0 + 1.2 * r for r in range(1, 9)}  # a gentle line: the likely drafts all pay
    assert plan_by_step_costs([0.7], [4], 1, line.__getitem__) == [4]
    # Two requests, the likelier one's drafts first; a setup cost can rule a request out.
    assert plan_by_step_costs([0.9, 0.3], [3, 3], 2, line.__getitem__) == [3, 0]
    assert plan_by_step_costs([0.9], [3], 1, line.__getitem__, setup=[100.0]) == [0]
    assert plan_by_step_costs([0.9, 0.9], [3, 3], 2, line.__getitem__, room=2) in ([2, 0], [1, 1])


def test_controller_plans_on_the_steps_it_timed():
    from types import SimpleNamespace

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    controller = SpecController(cfg, NgramProposer(cfg))  # dense: the fitted line until timed
    assert controller.step_costs is not None
    r = _decoding("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4])
    controller.kinds.counts[4] = [30.0, 10.0]  # ~0.74
    controller.propose([r])
    assert len(r.spec_token_ids) == 4  # the line: every likely draft pays
    for rows, ms in {1: 10.0, 2: 10.3, 3: 10.6, 4: 11.0, 5: 15.5}.items():
        for _ in range(3):
            item = SimpleNamespace(num_new_tokens=rows, spec_token_ids=[0] * (rows - 1))
            controller.observe_step(SimpleNamespace(scheduled=[item], num_batched_tokens=rows), ms / 1e3)
    controller.propose([r])
    assert len(r.spec_token_ids) == 3  # timed: the fifth row costs more than it brings
    # A step that prefills is not timed; a caller's explicit row_cost keeps the line.
    prefill = SimpleNamespace(num_new_tokens=7, spec_token_ids=[])
    controller.observe_step(SimpleNamespace(scheduled=[prefill], num_batched_tokens=7), 1.0)
    assert controller.step_costs.seconds_at(7) is None
    fixed = SpeculativeConfig(method="ngram", row_cost=0.1)
    assert SpecController(fixed, NgramProposer(fixed)).step_costs is None


def test_step_costs_trust_three_samples_take_the_median_and_forget_old_counts():
    from fornax.engine.spec_decode.controller import StepCosts

    costs = StepCosts()
    costs.observe(5, 0.010)
    costs.observe(5, 0.500)  # a hiccup
    assert costs.seconds_at(5) is None  # two samples: not yet
    costs.observe(5, 0.012)
    assert costs.seconds_at(5) == 0.012  # the median: the hiccup does not count
    for _ in range(StepCosts.MAX_AGE):
        costs.observe(1, 0.004)  # only one-row steps from now on
    assert costs.seconds_at(5) == 0.012  # still recent enough
    costs.observe(1, 0.004)
    assert costs.seconds_at(5) is None and costs.seconds_at(1) == 0.004  # forgotten, to be re-timed


def test_a_requests_own_record_of_a_kind_outweighs_the_global_rate():
    from fornax.engine.spec_decode.controller import AcceptanceByKind

    kinds = AcceptanceByKind()
    kinds.counts[4] = [80.0, 10.0]  # long matches are usually right...
    copying, summarising = {4: [6.0, 0.0]}, {4: [0.0, 2.0]}
    assert kinds.rate_for({}, 4) == kinds.rate(4)  # no record: the kind's rate
    assert kinds.rate_for(copying, 4) > kinds.rate(4)
    assert kinds.rate_for(summarising, 4) < 0.5  # ...but not in this request: two failures tell


# -- rejection sampling keeps the target distribution --


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    keep = probs * n >= 5
    expected = probs[keep] * n
    stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_matches_the_target_distribution():
    vocab, trials = 12, 3000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5  # rows: after 0, 1 and 2 drafts
    params = SamplingParams(temperature=0.8, top_k=8, max_tokens=50, seed=123)
    r = Request("a", [1, 2, 3], params)
    drafts = [int(logits[0].argmax()), 5]  # a likely first draft, an arbitrary second
    gens: dict[str, torch.Generator] = {}
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        tokens = verify_drafts(logits, [r], [drafts], gens).tokens[0]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:  # the second token is drawn given the first draft was kept
            second[tokens[1]] += 1

    def target(row: int) -> torch.Tensor:
        z = logits[row] / 0.8
        z[z < z.topk(8).values[-1]] = float("-inf")
        return torch.softmax(z, dim=-1)

    assert _chi_square_p(first, target(0)) > 1e-3
    assert _chi_square_p(second, target(1)) > 1e-3
    # Seeded: the same seed reproduces the same accept/reject decisions and tokens.
    again = [verify_drafts(logits, [r], [drafts], {}).tokens[0] for _ in range(2)]
    assert again[0] == again[1]


def test_greedy_verification_takes_the_argmax_and_stops_at_the_first_mismatch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    r = Request("g", [0], SamplingParams(temperature=0.0))
    assert verify_drafts(logits, [r], [[1, 0]], {}).tokens == [[1, 0, 2]]  # all accepted + bonus
    assert verify_drafts(logits, [r], [[1, 2]], {}).tokens == [[1, 0]]  # second draft rejected
    assert verify_drafts(logits, [r], [[2, 0]], {}).tokens == [[1]]  # first rejected
    # Penalties count the drafts before each row: after draft 0, token 0 is penalised.
    logits = torch.tensor([[3.0, 0.0, 0.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    pen = Request("p", [1], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    assert verify_drafts(logits, [r], [[0, 0]], {}).tokens == [[0, 0, 2]]
    assert verify_drafts(logits, [pen], [[0, 0]], {}).tokens == [[0, 2]]


def _plan_on_the_line(
    rates: list[float],
    max_counts: list[int],
    num_rows: int,
    unit: float,
    row_cost: float,
    steps: TargetSteps | None = None,
) -> list[int]:
    """The controller's plan before it has timed a step: on the fitted line, in units of a
    decode step's fixed cost, a row costing `row_cost` and a draft `unit` in all."""
    cfg = SpeculativeConfig(method="ngram", row_cost=row_cost, draft_cost=unit - row_cost)
    return SpecController(cfg, NgramProposer(cfg), steps)._plan(rates, max_counts, num_rows, unit, None)


def test_draft_budget_gives_one_stream_long_drafts_and_a_big_batch_few():
    # Free drafts (n-gram on a GPU-like cost model): everyone gets everything.
    assert _plan_on_the_line([0.1, 0.9], [4, 4], 2, unit=0.0, row_cost=0.0) == [4, 4]
    # One stream, good acceptance, rows cost 8% of a step: long drafts.
    assert _plan_on_the_line([0.8], [4], 1, unit=0.08, row_cost=0.08) == [4]
    # Poor acceptance: nothing pays.
    assert _plan_on_the_line([0.05], [4], 1, unit=0.5, row_cost=0.08) == [0]
    # Eight streams: the step's fixed cost is shared, so only the likeliest drafts pay.
    counts = _plan_on_the_line([0.9, 0.6, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], [4] * 8, 8, unit=0.08, row_cost=0.08)
    assert counts[0] >= counts[1] >= counts[2] and sum(counts) < 16
    # An expensive draft model in a batch of eight: no speculation at all.
    assert _plan_on_the_line([0.8] * 8, [3] * 8, 8, unit=0.45, row_cost=0.08) == [0] * 8


def test_draft_budget_keeps_a_small_step_under_the_row_limit():
    below = TargetSteps(quantized_max_rows=24)  # dense weights past 24 rows: never crossed
    # Free drafts, 8 streams, a limit of 24 rows: 16 drafts, the likeliest first.
    counts = _plan_on_the_line([0.9, 0.5] + [0.2] * 6, [4] * 8, 8, unit=0.0, row_cost=0.0, steps=below)
    assert sum(counts) == 16 and counts[0] == 4 and counts[1] == 4
    # At the limit already: none; over it (a dense step anyway): the limit does not apply.
    assert _plan_on_the_line([0.9] * 24, [3] * 24, 24, unit=0.0, row_cost=0.0, steps=below) == [0] * 24
    assert _plan_on_the_line([0.9] * 30, [3] * 30, 30, unit=0.0, row_cost=0.0, steps=below) == [3] * 30
    # No limit given: unchanged.
    assert _plan_on_the_line([0.9] * 8, [4] * 8, 8, unit=0.0, row_cost=0.0) == [4] * 8


def test_draft_budget_crosses_a_finite_cliff_only_when_the_drafts_pay_for_it():
    # One stream on int4 one-row steps, int8 x int8 past them (TIER_STEP_COST more): likely
    # drafts pay for the step up, unlikely ones do not, though each would pay for its own row.
    make_run = TargetSteps(quantized_max_rows=1, int8_large_steps=True)
    assert _plan_on_the_line([0.85], [4], 1, unit=0.12, row_cost=0.12, steps=make_run) == [4]
    assert _plan_on_the_line([0.3], [4], 1, unit=0.12, row_cost=0.12, steps=make_run) == [0]
    assert _plan_on_the_line([0.3], [4], 1, unit=0.12, row_cost=0.12) != [0]
    # An infinite cliff (dense weights past the limit) is never crossed; room below it is
    # used without paying anything.
    assert _plan_on_the_line([0.99], [4], 1, unit=0.12, row_cost=0.12, steps=TargetSteps(1)) == [0]
    three = TargetSteps(quantized_max_rows=3, int8_large_steps=True)
    assert _plan_on_the_line([0.3], [4], 1, unit=0.12, row_cost=0.12, steps=three) == [1]
    # Past the limit already: no cliff to pay.
    assert _plan_on_the_line([0.3], [4], 2, unit=0.12, row_cost=0.12, steps=make_run) != [0]
