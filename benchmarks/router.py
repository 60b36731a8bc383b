"""`fornax router` over two real `fornax serve` replicas: what cache-aware routing buys on a
prefix-sharing workload, and what the router adds to a request's latency.

a. Cache-aware vs round-robin. `fornax bench serve --dataset prefix-repetition` through the
   router (8 prefixes of ~1,000 tokens, short suffixes, short outputs, --requests requests at
   --concurrency), once per policy with fresh replicas (empty prefix caches) and the same
   seeded traffic; the order of the two arms alternates over --rounds. Each replica's KV
   cache holds --kv-prefixes requests' worth of blocks (default 4.5 of the 8 prefixes): the
   case cache-aware routing is for, where one replica cannot hold the working set but the two
   together can. Round-robin sends every prefix to both replicas, which keep evicting them;
   cache-aware keeps each prefix on one. The smaller the cache, down to half the prefixes,
   the wider the gap (with 6 prefixes' worth, a smoke run of 64 requests found 85% vs 60%).
   Per arm: the replicas' prefix-cache hit rate (tokens found / tokens looked up, from
   fornax:prefix_cache_hits / _queries on their /metrics) and TTFT p50/p90 (as the bench
   client saw it, through the router). Goals: hit rate cache-aware / round-robin >= 1.8,
   TTFT p50 cache-aware / round-robin <= 0.5.
b. Router-added latency. The same tiny request (POST /tokenize: relayed like a generation,
   and the replica's own work is small and steady) sent --latency-requests times directly to
   a replica and through a router in front of that replica alone, alternating, one at a
   time, over kept-alive connections. Goal: p50 through the router - p50 direct < 2 ms.

Replicas run make run's flags (--quantization auto --large-step-quantization w8a8) with
--num-threads 1 each, so two share the 2 cores without fighting over them. Run on a quiet
machine: other load inflates both TTFT and the latency figures.

    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/router.py --json router.json
    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/router.py --requests 64 --rounds 1   # smoke run

Exit status: 0 when every run completed (goals missed are reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _servers import MAKE_RUN_FLAGS, Process  # benchmarks/ is on sys.path when run as a script
from prometheus_client.parser import text_string_to_metric_families

from fornax.config import DEFAULT_MODEL

POLICIES = ("cache-aware", "round-robin")
# make run's flags, one compute thread each (two replicas on two cores).
REPLICA_FLAGS = [*MAKE_RUN_FLAGS, "--num-threads", "1"]
HIT_RATE_GOAL, TTFT_GOAL, ADDED_MS_GOAL = 1.8, 0.5, 2.0
BLOCK_SIZE = 16  # fornax serve's default --block-size


# ---- processes -----------------------------------------------------------------------------------


def start_replicas(args: argparse.Namespace, log_dir: Path, count: int = 2) -> list[Process]:
    flags = [
        *REPLICA_FLAGS,
        "--num-blocks",
        str(args.kv_blocks),
        "--max-model-len",
        "2048",
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    replicas = [Process(f"replica{i}", ["serve", args.model, *flags], log_dir) for i in range(count)]
    for replica in replicas:  # both load at once
        replica.wait_ready(lambda r: r.status_code == 200)
    return replicas


def start_router(replicas: list[Process], policy: str, log_dir: Path) -> Process:
    urls = [item for r in replicas for item in ("--replica", r.url)]
    router = Process(
        f"router-{policy}",
        [
            "router",
            *urls,
            "--policy",
            policy,
            "--poll-interval",
            "0.5",
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        log_dir,
    )
    router.wait_ready(lambda r: r.status_code == 200 and r.json().get("healthy_replicas") == len(replicas))
    return router


def stop_all(processes: list[Process]) -> None:
    for process in processes:
        process.stop()


# ---- a. cache-aware vs round-robin -----------------------------------------------------------------


@dataclass
class Arm:
    policy: str
    round: int
    hits: float  # prompt tokens found in the replicas' prefix caches
    queries: float  # prompt tokens looked up
    ttft_ms: list[float]  # every successful request's
    completed: int
    failed: int
    duration_s: float
    decisions: dict[str, float] = field(default_factory=dict)  # the router's, by reason

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        """For the JSON report: TTFT as percentiles, not every request's."""
        out = {k: v for k, v in asdict(self).items() if k != "ttft_ms"}
        return out | {
            "hit_rate": self.hit_rate,
            "ttft_p50_ms": percentile(self.ttft_ms, 50),
            "ttft_p90_ms": percentile(self.ttft_ms, 90),
        }


def prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens from a replica's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    totals = {"fornax:prefix_cache_hits": 0.0, "fornax:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["fornax:prefix_cache_hits"], totals["fornax:prefix_cache_queries"]


def routing_decisions(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fornax_router:routing_decisions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


def bench_command(args: argparse.Namespace, url: str, seed: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fornax.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        args.model,
        "--endpoint",
        "completions",
        "--dataset",
        "prefix-repetition",
        "--num-prompts",
        str(args.requests),
        "--num-prefixes",
        str(args.prefixes),
        "--prefix-len",
        str(args.prefix_len),
        "--suffix-len",
        str(args.suffix_len),
        "--random-output-len",
        str(args.output_len),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(seed),
        "--no-progress",
        "--json",
        str(out),
    ]


def run_arm(args: argparse.Namespace, policy: str, round_no: int, log_dir: Path) -> Arm:
    """Fresh replicas and router, one bench run through it, the counters read after."""
    replicas = start_replicas(args, log_dir)
    processes = list(replicas)
    try:
        router = start_router(replicas, policy, log_dir)
        processes.append(router)
        out = log_dir / f"bench-{policy}-{round_no}.json"
        done = subprocess.run(bench_command(args, router.url, round_no, out), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fornax bench serve failed ({done.returncode}):\n{done.stderr[-2000:]}")
        report = json.loads(out.read_text())
        hits = queries = 0.0
        for replica in replicas:
            h, q = prefix_counters(replica.url)
            hits, queries = hits + h, queries + q
        ok = [r for r in report["requests"] if r["success"] and r.get("ttft_s") is not None]
        summary = report["summary"]
        return Arm(
            policy,
            round_no,
            hits,
            queries,
            [r["ttft_s"] * 1000.0 for r in ok],
            summary["completed"],
            summary["failed"],
            summary["duration_s"],
            routing_decisions(router.url),
        )
    finally:
        stop_all(processes)


def compare_policies(args: argparse.Namespace, log_dir: Path) -> list[Arm]:
    arms: list[Arm] = []
    for round_no in range(args.rounds):
        order = POLICIES if round_no % 2 == 0 else POLICIES[::-1]  # neither always goes first
        for policy in order:
            arm = run_arm(args, policy, round_no, log_dir)
            print(
                f"  round {round_no} {policy:<12} hit rate {arm.hit_rate:6.1%}  TTFT p50 "
                f"{percentile(arm.ttft_ms, 50):8.1f} ms  ({arm.completed} ok, {arm.failed} failed)",
                file=sys.stderr,
            )
            arms.append(arm)
    return arms


def policy_summary(arms: list[Arm], policy: str) -> dict[str, Any]:
    """All rounds of one policy pooled: token hit rate, TTFT percentiles over every request."""
    mine = [a for a in arms if a.policy == policy]
    hits, queries = sum(a.hits for a in mine), sum(a.queries for a in mine)
    ttft = [t for a in mine for t in a.ttft_ms]
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "completed": sum(a.completed for a in mine),
        "failed": sum(a.failed for a in mine),
    }


# ---- b. router-added latency --------------------------------------------------------------------------


def added_latency(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Direct to one replica vs through a router in front of it alone, alternating."""
    replicas = start_replicas(args, log_dir, count=1)
    processes = list(replicas)
    try:
        router = start_router(replicas, "round-robin", log_dir)
        processes.append(router)
        direct, routed = time_alternating(replicas[0].url, router.url, args.model, args.latency_requests)
    finally:
        stop_all(processes)
    return {
        "request": "POST /tokenize",
        "n": args.latency_requests,
        "direct_p50_ms": percentile(direct, 50),
        "direct_p90_ms": percentile(direct, 90),
        "router_p50_ms": percentile(routed, 50),
        "router_p90_ms": percentile(routed, 90),
        "added_p50_ms": percentile(routed, 50) - percentile(direct, 50),
    }


def time_alternating(direct_url: str, router_url: str, model: str, n: int) -> tuple[list[float], list[float]]:
    body = json.dumps({"model": model, "prompt": "How long does the router take?"}).encode()
    headers = {"content-type": "application/json"}
    times: dict[str, list[float]] = {direct_url: [], router_url: []}
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        for url in times:  # connections open, code paths warm
            for _ in range(20):
                client.post(url + "/tokenize", content=body, headers=headers).raise_for_status()
        for _ in range(n):
            for url, out in times.items():
                start = time.perf_counter()
                client.post(url + "/tokenize", content=body, headers=headers).raise_for_status()
                out.append((time.perf_counter() - start) * 1000.0)
    return times[direct_url], times[router_url]


# ---- report --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(arms: list[Arm], latency: dict[str, Any] | None) -> dict[str, Any]:
    """Print the table; the JSON document."""
    doc: dict[str, Any] = {"arms": [a.to_dict() for a in arms]}
    lines: list[str] = []
    if arms:
        doc |= policy_lines(arms, lines)
    if latency is not None:
        doc["latency"] = latency
        lines.append(latency_line(latency))
    print("\n".join(lines))
    return doc


def policy_lines(arms: list[Arm], lines: list[str]) -> dict[str, Any]:
    ca, rr = policy_summary(arms, "cache-aware"), policy_summary(arms, "round-robin")
    hit_ratio = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    ttft_ratio = ca["ttft_p50_ms"] / rr["ttft_p50_ms"]
    lines.append(f"{'policy':<14}{'hit rate':>10}{'TTFT p50':>12}{'TTFT p90':>12}{'ok':>7}{'failed':>8}")
    for name, s in (("cache-aware", ca), ("round-robin", rr)):
        lines.append(
            f"{name:<14}{s['hit_rate']:>10.1%}{s['ttft_p50_ms']:>10.1f}ms"
            f"{s['ttft_p90_ms']:>10.1f}ms{s['completed']:>7}{s['failed']:>8}"
        )
    lines.append(
        f"cache-aware / round-robin: hit rate {hit_ratio:.2f}x (goal >= {HIT_RATE_GOAL}: "
        f"{mark(hit_ratio >= HIT_RATE_GOAL)}), TTFT p50 {ttft_ratio:.2f}x (goal <= {TTFT_GOAL}: "
        f"{mark(ttft_ratio <= TTFT_GOAL)})"
    )
    return {"cache_aware": ca, "round_robin": rr, "hit_rate_ratio": hit_ratio, "ttft_p50_ratio": ttft_ratio}


def latency_line(lat: dict[str, Any]) -> str:
    added = lat["added_p50_ms"]
    return (
        f"{lat['request']} x{lat['n']}: direct p50 {lat['direct_p50_ms']:.2f} / p90 "
        f"{lat['direct_p90_ms']:.2f} ms; through the router p50 {lat['router_p50_ms']:.2f} / p90 "
        f"{lat['router_p90_ms']:.2f} ms; "
        f"added p50 {added:.2f} ms (goal < {ADDED_MS_GOAL}: {mark(added < ADDED_MS_GOAL)})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=256, help="requests per arm")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="runs of each policy, alternating which goes first")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument(
        "--kv-prefixes",
        type=float,
        default=4.5,
        help="each replica's KV cache, in requests' worth of tokens (prefix + suffix + output)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="each replica's KV cache in 16-token blocks (overrides --kv-prefixes)",
    )
    p.add_argument("--latency-requests", type=int, default=500, help="b: requests each way")
    p.add_argument("--skip-policies", action="store_true", help="only b")
    p.add_argument("--skip-latency", action="store_true", help="only a")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--log-dir", default=None, help="replica, router and bench output (default: a temp dir)")
    args = p.parse_args(argv)
    if args.kv_blocks is None:
        tokens = args.kv_prefixes * (args.prefix_len + args.suffix_len + args.output_len)
        args.kv_blocks = math.ceil(tokens / BLOCK_SIZE)
    if min(args.requests, args.concurrency, args.rounds, args.latency_requests, args.kv_blocks) < 1:
        p.error("counts must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="fornax-router-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", file=sys.stderr)
    arms = [] if args.skip_policies else compare_policies(args, log_dir)
    latency = None if args.skip_latency else added_latency(args, log_dir)
    doc = report(arms, latency)
    if args.json:
        doc["config"] = vars(args)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
