"""KV cache tiers (engine/kv/offload) on real servers: what they buy when a long shared prefix
does not stay in the primary pool, what they cost when nothing is reused.

a. Shared document. One ~2,000-token document asked --questions different questions, one at a
   time; between two questions an unrelated ~2,000-token request passes through, and the
   primary pool (--num-blocks, default 140 blocks of 16 = 2,240 tokens) cannot hold both, so the
   document is evicted every time. TTFT p50 of the questions:
     cold   no tiers: the document is recomputed for every question
     tiers  --kv-offload-memory 4GiB --kv-offload-dir D: it comes back from host memory
   Goal: tiers / cold <= 0.2.
b. Restart. After arm "tiers" drained on SIGTERM, a new server on the same D answers one new
   question (the document now comes from disk); --restarts times. Goal: its TTFT p50 / cold
   <= 0.3.
c. No reuse. `fornax bench serve --dataset random` (512-token prompts, 64-token outputs, 32 at
   a time, --requests requests) without tiers, with tier 1 only, and with both tiers, on a
   primary pool that fills up after ~40 requests (1,400 blocks), so evicted blocks are saved all
   along (and, with the disk tier, every finished request's blocks are written). Goal: output
   tok/s with tiers / without >= 0.97. Arms rotate over --rounds.

Servers run make run's flags (--quantization auto --large-step-quantization w8a8) on every core.

    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/kv_offload.py --json kv_offload.json
    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/kv_offload.py --questions 4 --restarts 2 --requests 32 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _servers import MAKE_RUN_FLAGS, Process  # benchmarks/ is on sys.path when run as a script

from fornax.config import DEFAULT_MODEL

SERVER_FLAGS = [
    *MAKE_RUN_FLAGS,
    "--max-model-len",
    "4096",
    "--no-access-log",
    "--log-level",
    "warning",
]
TIER_FLAGS = ["--kv-offload-memory", "4GiB"]
TTFT_GOAL, RESTART_GOAL, THROUGHPUT_GOAL = 0.2, 0.3, 0.97
DOC_TOKENS = 2000
QUESTION_TOKENS = 24


def token_ids(rng: random.Random, n: int) -> list[int]:
    """Token ids from the middle of the vocabulary (ordinary word pieces), reproducible."""
    return [rng.randrange(1000, 40000) for _ in range(n)]


def ttft_ms(url: str, model: str, prompt: list[int], max_tokens: int = 8) -> tuple[float, int]:
    """Streamed /v1/completions: ms to the first token's chunk, and the usage's cached tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):  # a token (its text may still be empty)
                first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert first is not None, "no token streamed"
    return (first - start) * 1e3, cached


def serve(args: argparse.Namespace, log_dir: Path, extra: list[str], num_blocks: int) -> Process:
    server = Process(
        "serve", ["serve", args.model, *SERVER_FLAGS, "--num-blocks", str(num_blocks), *extra], log_dir
    )
    server.wait_ready(lambda r: r.status_code == 200)
    return server


def shared_document(
    args: argparse.Namespace, log_dir: Path, extra: list[str], rng: random.Random, doc: list[int]
) -> dict[str, Any]:
    """Questions about `doc`, each after an unrelated request that evicts it."""
    server = serve(args, log_dir, extra, args.num_blocks)
    try:
        ttfts, cached = [], []
        for _ in range(args.questions):
            ttft_ms(server.url, args.model, token_ids(rng, DOC_TOKENS), max_tokens=1)  # evicts the document
            t, c = ttft_ms(server.url, args.model, doc + token_ids(rng, QUESTION_TOKENS))
            ttfts.append(t)
            cached.append(c)
        metrics = httpx.get(server.url + "/metrics", timeout=10.0).text
    finally:
        server.stop()
    hits = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("fornax:kv_offload_hit_tokens_total")
    }
    return {
        "ttft_ms": ttfts,
        "ttft_p50_ms": statistics.median(ttfts),
        "cached_tokens": cached,
        "offload_hits": hits,
    }


def after_restart(
    args: argparse.Namespace, log_dir: Path, extra: list[str], rng: random.Random, doc: list[int]
) -> dict[str, Any]:
    ttfts, cached = [], []
    for _ in range(args.restarts):
        server = serve(args, log_dir, extra, args.num_blocks)
        try:
            t, c = ttft_ms(server.url, args.model, doc + token_ids(rng, QUESTION_TOKENS))
        finally:
            server.stop()
        ttfts.append(t)
        cached.append(c)
    return {"ttft_ms": ttfts, "ttft_p50_ms": statistics.median(ttfts), "cached_tokens": cached}


def no_reuse(args: argparse.Namespace, log_dir: Path, extra: list[str], seed: int) -> float:
    """Output tok/s of `fornax bench serve` on unique random prompts."""
    server = serve(args, log_dir, extra, 1400)
    out = log_dir / f"bench-{seed}-{len(extra)}-{time.monotonic_ns()}.json"
    try:
        cmd = [
            sys.executable,
            "-m",
            "fornax.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--model",
            args.model,
            "--endpoint",
            "completions",
            "--dataset",
            "random",
            "--random-input-len",
            "512",
            "--random-output-len",
            "64",
            "--num-prompts",
            str(args.requests),
            "--max-concurrency",
            "32",
            "--seed",
            str(seed),
            "--no-progress",
            "--json",
            str(out),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    finally:
        server.stop()
    report = json.loads(out.read_text())
    assert report["summary"]["failed"] == 0, "requests failed"
    return float(report["summary"]["output_throughput"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--requests", type=int, default=128, help="requests per no-reuse arm")
    p.add_argument("--rounds", type=int, default=2, help="no-reuse arm pairs, alternating")
    p.add_argument("--num-blocks", type=int, default=140)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "model": args.model}
    with tempfile.TemporaryDirectory(prefix="fornax-kv-offload-") as tmp:
        log_dir, disk = Path(tmp), Path(tmp) / "kv"
        tiers = [*TIER_FLAGS, "--kv-offload-dir", str(disk)]
        doc = token_ids(random.Random(7), DOC_TOKENS)
        for arm, extra in (("cold", []), ("tiers", tiers)):
            result[arm] = shared_document(args, log_dir, extra, random.Random(11), doc)
            print(
                f"{arm}: TTFT p50 {result[arm]['ttft_p50_ms']:.0f} ms, cached {result[arm]['cached_tokens']}",
                flush=True,
            )
        result["restart"] = after_restart(args, log_dir, tiers, random.Random(13), doc)
        print(
            f"restart: TTFT p50 {result['restart']['ttft_p50_ms']:.0f} ms, cached "
            f"{result['restart']['cached_tokens']}",
            flush=True,
        )
        throughput: dict[str, list[float]] = {"without": [], "host": [], "host+disk": []}
        for round_no in range(args.rounds):
            arms = [
                ("without", []),
                ("host", TIER_FLAGS),
                ("host+disk", [*TIER_FLAGS, "--kv-offload-dir", str(Path(tmp) / f"nr{round_no}")]),
            ]
            for name, extra in arms if round_no % 2 == 0 else arms[::-1]:
                throughput[name].append(no_reuse(args, log_dir, extra, seed=100 + round_no))
                print(f"no reuse, {name} tiers: {throughput[name][-1]:.1f} output tok/s", flush=True)
        result["no_reuse_tok_s"] = throughput
    cold = result["cold"]["ttft_p50_ms"]
    ratios = {
        "ttft_tiers_vs_cold": result["tiers"]["ttft_p50_ms"] / cold,
        "ttft_restart_vs_cold": result["restart"]["ttft_p50_ms"] / cold,
        "throughput_host_vs_without": statistics.median(throughput["host"])
        / statistics.median(throughput["without"]),
        "throughput_host_disk_vs_without": (
            statistics.median(throughput["host+disk"]) / statistics.median(throughput["without"])
        ),
    }
    result["ratios"] = ratios
    goals = {
        "ttft_tiers_vs_cold": ("<=", TTFT_GOAL),
        "ttft_restart_vs_cold": ("<=", RESTART_GOAL),
        "throughput_host_vs_without": (">=", THROUGHPUT_GOAL),
        "throughput_host_disk_vs_without": (">=", THROUGHPUT_GOAL),
    }
    for key, value in ratios.items():
        op, goal = goals[key]
        met = value <= goal if op == "<=" else value >= goal
        print(f"{key}: {value:.3f} (goal {op} {goal}: {'met' if met else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
