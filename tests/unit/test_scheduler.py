"""Scheduler driven by a fake runner that really writes and reads a simulated paged KV cache.

The fake runner stores each computed token in its (block, slot) and, before computing a
request's new tokens, reads the request's whole context back through its block table. So a
wrong block table, a prefix hit on the wrong block, a block reused while still in use, or a
preempted request resumed from the wrong state fails loudly, and the "sampled" token is a
function of what the cache actually holds.
"""

from __future__ import annotations

import pytest

from fornax.config import CacheConfig, SchedulerConfig
from fornax.engine.outputs import ModelRunnerOutput, SchedulerOutput
from fornax.engine.request import Request, RequestStatus, SamplingParams
from fornax.engine.scheduler import Scheduler


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.bs = scheduler.block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, int] = {}
        pool = self.scheduler.kv.pool
        for s in out.scheduled:
            r, start, end = s.request, s.start, s.start + s.num_new_tokens
            assert s.num_new_tokens > 0
            assert len(s.block_ids) == -(-end // self.bs), "table must cover exactly the tokens"
            context = [self.slots[(s.block_ids[t // self.bs], t % self.bs)] for t in range(start)]
            assert context == r.all_token_ids[:start], f"{r.request_id}: KV cache holds the wrong tokens"
            for t in range(start, end):
                block_id = s.block_ids[t // self.bs]
                assert pool.blocks[block_id].ref_cnt == 1, "writing into a shared block"
                self.slots[(block_id, t % self.bs)] = r.all_token_ids[t]
            if s.samples:
                # Deterministic, a function of the whole sequence as read back from the cache,
                # and independent of how the prompt was chunked.
                seq = context + r.all_token_ids[start:end]
                sampled[r.request_id] = sum((t + 1) * tok for t, tok in enumerate(seq)) * 31 % 97
        return ModelRunnerOutput(sampled=sampled)


def make(
    num_blocks: int = 256,
    block_size: int = 16,
    budget: int = 2048,
    max_num_seqs: int = 64,
    policy: str = "fcfs",
    prefix_caching: bool = True,
    threshold: int = 0,
    max_model_len: int = 8192,
) -> tuple[Scheduler, FakeRunner]:
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        policy=policy,
        long_prefill_token_threshold=threshold,
    )
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    sched = Scheduler(sc, cc, num_blocks)
    return sched, FakeRunner(sched)


def req(rid: str, prompt: list[int] | int, max_tokens: int = 8, priority: int = 0, **kw: object) -> Request:
    offset = 17 * sum(map(ord, rid))  # deterministic (str hash() is salted per process)
    tokens = prompt if isinstance(prompt, list) else [(offset + i) % 100 for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, tokens, params, priority=priority)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
    assert all(s.num_new_tokens > 0 for s in out.scheduled)
    assert not out.preempted_request_ids & {s.request.request_id for s in out.scheduled}
    changed = sched.update_from_output(out, runner.execute(out))
    sched.kv.check_integrity()
    return out, changed


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Step until done; never two empty steps in a row (no livelock)."""
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert not (out.is_empty and outs and outs[-1].is_empty), "no progress in two steps"
        outs.append(out)
        assert len(outs) < max_steps
    assert sched.kv.usage == 0.0 and sched.num_running == 0 and sched.num_waiting == 0
    return outs


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_chunked_prefill_keeps_decodes_flowing() -> None:
    sched, runner = make(num_blocks=256, budget=256)
    shorts = [req("s0", 10, max_tokens=40), req("s1", 12, max_tokens=40)]
    for r in shorts:
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"s0": 10, "s1": 12}
    long = req("long", 2000, max_tokens=4)
    sched.add_request(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        out, _ = step(sched, runner)
        assert out.num_batched_tokens <= 256
        n = new_tokens(out)
        assert n["s0"] == n["s1"] == 1  # decodes run first, every step: a mixed batch
        assert n["long"] == min(254, 2000 - 254 * prefill_steps)
        prefill_steps += 1
    assert prefill_steps == 8 == -(-2000 // 256)
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"s0": 1, "s1": 1, "long": 1}
    run(sched, runner)
    assert long.num_output_tokens == 4 and all(r.num_output_tokens == 40 for r in shorts)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in shorts + [long])


def test_long_prefill_threshold_caps_chunks() -> None:
    sched, runner = make(budget=1000, threshold=100)
    sched.add_request(req("a", 250, max_tokens=2))
    sched.add_request(req("b", 30, max_tokens=2))
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"a": 100, "b": 30}
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"a": 100, "b": 1}
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"a": 50}
    run(sched, runner)


def test_budget_spans_many_requests_and_max_num_seqs_caps_running() -> None:
    sched, runner = make(budget=64, max_num_seqs=3)
    reqs = [req(f"r{i}", 30, max_tokens=5) for i in range(7)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    # 30 + 30 + 4: the third request starts with a 4-token chunk; the budget is used up.
    assert new_tokens(out) == {"r0": 30, "r1": 30, "r2": 4}
    assert sched.num_running == 3 and sched.num_waiting == 4
    outs = run(sched, runner)
    assert all(len(o.scheduled) <= 3 for o in outs)
    assert all(r.num_output_tokens == 5 for r in reqs)
    # FCFS: requests are first scheduled in arrival order.
    first = [r.times.first_scheduled for r in reqs]
    assert first == sorted(first)


def _workload() -> list[Request]:
    shared = [(5 * i) % 100 for i in range(10)]  # two sequences of one prompt, like n=2
    return [req(f"p{i}", 6 + 3 * i, max_tokens=12 + i) for i in range(5)] + [
        req("p5", shared, max_tokens=14),
        req("p6", list(shared), max_tokens=15),
    ]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_to_identical_outputs(policy: str, prefix_caching: bool) -> None:
    ref_sched, ref_runner = make(num_blocks=1000, block_size=4, policy=policy, prefix_caching=prefix_caching)
    ref_reqs = _workload()
    for r in ref_reqs:
        ref_sched.add_request(r)
    run(ref_sched, ref_runner)
    assert ref_sched.num_preemptions_total == 0
    expected = {r.request_id: r.output_token_ids for r in ref_reqs}

    sched, runner = make(num_blocks=10, block_size=4, budget=32, policy=policy, prefix_caching=prefix_caching)
    reqs = _workload()
    for i, r in enumerate(reqs):
        r.priority = i % 2  # matters only for 'priority'
        sched.add_request(r)
    outs = run(sched, runner)
    assert sched.num_preemptions_total > 0
    assert sum(len(o.preempted_request_ids) for o in outs) == sched.num_preemptions_total
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions_total
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    assert sched.kv.usage == 0.0 and sched.kv.num_free_blocks == 10


def test_fcfs_preempts_the_newest_and_requeues_it_first() -> None:
    sched, runner = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=16), req("b", 8, max_tokens=16)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # a: blocks 0 1, b: blocks 2 3
    assert sched.kv.get_block_ids("a") == [0, 1] and sched.kv.get_block_ids("b") == [2, 3]
    for _ in range(4):  # positions 8..11 live in a third block each: a 4, b 5
        out, _ = step(sched, runner)
        assert not out.preempted_request_ids
    assert sched.kv.get_block_ids("b") == [2, 3, 5] and sched.kv.num_free_blocks == 0
    out, _ = step(sched, runner)  # a needs a 4th block: b (newest) is preempted
    assert out.preempted_request_ids == {"b"}
    assert new_tokens(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.waiting.peek() is b and sched.kv.get_block_ids("b") == []
    # b's blocks were freed in reverse, so its last block (5) was evicted first.
    assert sched.kv.get_block_ids("a") == [0, 1, 4, 5]
    assert [blk.block_id for blk in sched.kv.pool.free_queue] == [3, 2]
    c = req("c", 3)
    sched.add_request(c)
    # b would hit its own blocks 2 and 3 but needs 2 more: nothing is admitted, and c,
    # although it came later, stays behind the preempted b.
    out, _ = step(sched, runner)
    assert new_tokens(out) == {"a": 1} and list(sched.waiting) == [b, c]
    run(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 16 and c.num_output_tokens == 8
    assert b.num_cached_tokens == 0  # recorded at first admission only


def test_a_request_that_preempts_itself_waits() -> None:
    sched, runner = make(num_blocks=3, block_size=4, budget=64)
    a = req("a", 4, max_tokens=9)  # needs up to 12 tokens = 3 blocks
    b = req("b", 4, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)  # both need a 2nd block, one is free: b (newest) yields
    assert out.preempted_request_ids == {"b"} and new_tokens(out) == {"a": 1}
    run(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 9


def test_priority_self_preemption_lets_the_others_run() -> None:
    sched, runner = make(num_blocks=2, block_size=4, budget=64, policy="priority")
    x = req("x", 4, max_tokens=5, priority=9)
    y = req("y", 3, max_tokens=6, priority=0)
    sched.add_request(x)
    sched.add_request(y)
    step(sched, runner)  # x takes block 0, y block 1; x comes first in running order
    out, _ = step(sched, runner)  # x needs a 2nd block: it is the lowest priority itself
    assert out.preempted_request_ids == {"x"} and new_tokens(out) == {"y": 1}
    run(sched, runner)
    assert x.num_output_tokens == 5 and y.num_output_tokens == 6


def test_output_is_capped_to_fit_the_whole_cache_alone() -> None:
    sched, runner = make(num_blocks=2, block_size=4)
    r = req("r", 5, max_tokens=100)  # 8 slots: at most 8 - 5 + 1 = 4 sampled tokens
    sched.add_request(r)
    run(sched, runner)
    assert r.num_output_tokens == 4 and r.status == RequestStatus.FINISHED_LENGTH


def test_abort_from_waiting_and_running_frees_everything() -> None:
    sched, runner = make(num_blocks=32, block_size=4, max_num_seqs=2)
    reqs = [req(f"r{i}", 10, max_tokens=50) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert sched.abort_request("r2")  # waiting
    assert reqs[2].status == RequestStatus.FINISHED_ABORTED and sched.num_waiting == 0
    used = sched.kv.num_blocks - sched.kv.num_free_blocks
    assert sched.abort_request("r0")  # running
    assert sched.kv.get_block_ids("r0") == [] and sched.kv.num_blocks - sched.kv.num_free_blocks == used - 3
    assert not sched.abort_request("r0") and not sched.abort_request("nope")
    sched.kv.check_integrity()
    out, _ = step(sched, runner)
    assert out.finished_request_ids == {"r0", "r2"} and new_tokens(out) == {"r1": 1}
    # Aborted between schedule() and update_from_output(): its step result is ignored.
    out = sched.schedule()
    result = runner.execute(out)
    assert sched.abort_request("r1")
    assert sched.update_from_output(out, result) == []
    assert reqs[1].num_output_tokens == 2
    assert not sched.has_unfinished_requests() and sched.kv.usage == 0.0
    sched.kv.check_integrity()
    assert sched.schedule().finished_request_ids == {"r1"}
    assert sched.schedule().finished_request_ids == set()


def test_stop_token_and_external_finish_free_through_the_same_path() -> None:
    sched, runner = make(num_blocks=32, block_size=4)
    r = req("r", 5, max_tokens=50)
    sched.add_request(r)
    step(sched, runner)
    first = r.output_token_ids[0]
    # Same prompt again, stopping on the token it is known to produce first.
    s = req("s", r.prompt_token_ids, max_tokens=50, stop_token_ids=[first])
    sched.add_request(s)
    _, changed = step(sched, runner)
    assert s in changed and s.status == RequestStatus.FINISHED_STOPPED and s.stop_reason == first
    assert sched.get_request("s") is None and sched.kv.get_block_ids("s") == []
    assert sched.finish_request("r", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert sched.kv.usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == {"r", "s"}
    sched.kv.check_integrity()


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched, runner = make(max_num_seqs=1, policy="priority")
    prios = {"a": 3, "b": 1, "c": 2, "d": 1, "e": 0}
    for rid, p in prios.items():
        sched.add_request(req(rid, 5, max_tokens=2, priority=p))
    outs = run(sched, runner)
    order: list[str] = []
    for o in outs:
        for s in o.scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == ["e", "b", "d", "c", "a"]


def test_priority_preemption_takes_back_an_already_scheduled_request() -> None:
    sched, runner = make(num_blocks=4, block_size=4, budget=64, policy="priority")
    low = req("low", 2, max_tokens=10, priority=5)
    high = req("high", 4, max_tokens=10, priority=0)
    sched.add_request(low)
    step(sched, runner)  # low is admitted first and stays first in running order
    sched.add_request(high)
    while not sched.num_preemptions_total:
        out, _ = step(sched, runner)
    # low was scheduled (it needed no block) before high ran out of blocks; as the
    # lowest priority it is taken back out of this step and preempted.
    assert out.preempted_request_ids == {"low"} and new_tokens(out) == {"high": 1}
    assert low.num_output_tokens == 6
    run(sched, runner)
    assert low.num_output_tokens == high.num_output_tokens == 10


def test_prefix_cache_hit_for_a_request_sharing_a_256_token_prefix() -> None:
    sched, runner = make(num_blocks=128, block_size=16, budget=512)
    prefix = [(7 * i) % 100 for i in range(256)]
    a = req("a", prefix + [1] * 20, max_tokens=4)
    sched.add_request(a)
    run(sched, runner)
    assert a.num_cached_tokens == 0
    b = req("b", prefix + [2] * 30, max_tokens=4)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 256 >= 240
    assert new_tokens(out) == {"b": 30} and out.scheduled[0].start == 256
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    assert sched.kv.prefix_cache_hits == 256
    assert sched.kv.prefix_cache_queries == 276 + 286


def test_bad_requests_raise_clear_errors() -> None:
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"100 tokens.*100") as e:
        sched.add_request(req("x", 100))
    assert "maximum context length is 100" in str(e.value)
    with pytest.raises(ValueError, match=r"16 tokens.*16 tokens"):
        sched.add_request(req("y", 16))  # 16 + 1 tokens need 5 blocks, there are 4
    sched.add_request(req("z", 15))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("z", 3))
    assert sched.num_waiting == 1


def test_request_rejects_out_of_range_priority_and_clamps_top_k():
    import pytest

    from fornax.engine.request import Request, SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError) as err:
        Request("r", [1, 2], SamplingParams(), priority=10**30)
    assert err.value.param == "priority"
    params = SamplingParams(top_k=10**6)
    params.validate_against_vocab(1000)
    assert params.top_k == 0
