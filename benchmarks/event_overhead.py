"""What the lifecycle-event bus (fornax/engine/events.py) costs the engine's throughput.

Three ways to run the same offline workload through one loaded engine:

  absent    core.event_tap = None: not even the `bus.active` check (the baseline)
  idle      the bus as `fornax serve` has it, with nobody subscribed (what the claim is about)
  watched   one subscriber in another thread's event loop, reading every event (the UI's case)

Rounds interleave the modes in a shuffled order, so drift in the shared machine's speed hits
all of them alike; the report gives each mode's median tokens/s and its ratio to `absent`.

On a shared machine that end-to-end ratio carries a few percent of noise either way, far more
than the bus's idle cost, so the script also measures that cost directly: the time of the
engine's idle check (two per step) against the median step time, and, when watched, the time
spent inside the tap (building and publishing events) against the total run time.

    python benchmarks/event_overhead.py            # ~1-2 minutes on the 2-core dev machine
    python benchmarks/event_overhead.py --rounds 9 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fornax import LLM, SamplingParams
from fornax.engine.event_tap import EventTap
from fornax.engine.events import Subscription

MODES = ("absent", "idle", "watched")


class Watcher:
    """A subscriber in its own thread's event loop that reads (and counts) every event."""

    def __init__(self, llm: LLM) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.count = 0
        self.sub: Subscription = llm.engine.events.subscribe(loop=self.loop)
        self.task = asyncio.run_coroutine_threadsafe(self._read(), self.loop)

    async def _read(self) -> None:
        while True:
            await self.sub.get()
            self.count += 1

    def close(self) -> None:
        self.sub.close()
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class TimedTap(EventTap):
    """The real tap, timing its own calls (only used in `watched` runs)."""

    spent_s = 0.0

    def on_schedule(self, core, sched) -> None:
        start = time.perf_counter()
        super().on_schedule(core, sched)
        TimedTap.spent_s += time.perf_counter() - start

    def on_outputs(self, core, outputs) -> None:
        start = time.perf_counter()
        super().on_outputs(core, outputs)
        TimedTap.spent_s += time.perf_counter() - start


def idle_check_s(llm: LLM) -> float:
    """Seconds per step of the idle bus: the guard EngineCore.step evaluates, twice a step."""
    core = llm.engine
    n = 1_000_000
    per_check = (
        timeit.timeit("core.event_tap is not None and core.events.active", globals={"core": core}, number=n)
        / n
    )
    return 2 * per_check


def median_step_s(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Median wall time of one EngineCore.step over a pass of the workload."""
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"step-{i}", p, params)
    times = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_once(
    llm: LLM, mode: str, prompts: list[list[int]], params: SamplingParams, tap: object
) -> tuple[float, int]:
    """Output tokens/s of one pass over the workload in `mode`, and the events published."""
    core = llm.engine
    core.event_tap = None if mode == "absent" else tap
    watcher = Watcher(llm) if mode == "watched" else None
    published = core.events.num_published
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        if watcher is not None:
            watcher.close()
        core.event_tap = tap
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, core.events.num_published - published


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 keeps a shared machine's other load from stalling every op",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # No prefix caching: every pass must do the same work, not reuse the previous pass's blocks.
    llm = LLM(args.model, enable_prefix_caching=False, progress=False)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(rng.randrange(48, 129))]
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tap = TimedTap(llm.engine.events, llm.engine.cache_config.block_size)
    llm.engine.event_tap = tap
    run_once(llm, "idle", prompts, params, tap)  # warm-up: allocator, kernels, caches
    step_s, check_s = median_step_s(llm, prompts, params), idle_check_s(llm)
    watched_s = 0.0

    results: dict[str, list[float]] = {m: [] for m in MODES}
    events: dict[str, int] = dict.fromkeys(MODES, 0)
    order = list(MODES)
    for r in range(args.rounds):
        rng.shuffle(order)
        for mode in order:
            start = time.perf_counter()
            tps, n_events = run_once(llm, mode, prompts, params, tap)
            if mode == "watched":
                watched_s += time.perf_counter() - start
            results[mode].append(tps)
            events[mode] += n_events
        line = "  ".join(f"{m} {results[m][-1]:7.1f}" for m in MODES)
        print(f"round {r + 1}/{args.rounds}: {line}", flush=True)

    base = statistics.median(results["absent"])
    report = {
        "rounds": args.rounds,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "median_tokens_per_s": {m: statistics.median(results[m]) for m in MODES},
        "ratio_to_absent": {m: statistics.median(results[m]) / base for m in MODES},
        # Paired: each round's ratio to that round's `absent`, then the median. Rounds drift
        # together, so this cancels much of the machine's slow drift the plain medians keep.
        "paired_ratio_to_absent": {
            m: statistics.median(x / a for x, a in zip(results[m], results["absent"])) for m in MODES
        },
        "events_per_pass": {m: events[m] // args.rounds for m in MODES},
        "median_step_s": step_s,
        "idle_check_per_step_s": check_s,
        "idle_check_fraction_of_step": check_s / step_s,
        "watched_tap_fraction_of_time": TimedTap.spent_s / watched_s if watched_s else 0.0,
        "samples": results,
    }
    print(f"\n{'mode':8} {'median tok/s':>12} {'vs absent':>10} {'paired':>8} {'events/pass':>12}")
    for m in MODES:
        ratio, paired = report["ratio_to_absent"][m], report["paired_ratio_to_absent"][m]
        print(
            f"{m:8} {report['median_tokens_per_s'][m]:12.1f} {ratio:10.3f} {paired:8.3f} "
            f"{report['events_per_pass'][m]:12d}"
        )
    idle_cost = 1.0 - report["paired_ratio_to_absent"]["idle"]
    print(
        f"\nend to end, idle bus vs absent (paired median): {100 * idle_cost:+.2f}% throughput cost "
        f"(noise included; claim: under 2%)"
    )
    print(
        f"direct: the idle check costs {1e9 * check_s:.0f} ns per step, a median step takes "
        f"{1e3 * step_s:.1f} ms: {100 * check_s / step_s:.5f}% of a step"
    )
    print(
        f"watched: building and publishing events took {100 * report['watched_tap_fraction_of_time']:.2f}% "
        f"of the watched runs' time"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
