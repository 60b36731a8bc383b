"""`fornax bench serve`: load-test any OpenAI-compatible server over HTTP and report latencies.

    fornax bench serve --base-url http://127.0.0.1:8000 --model M \
        --dataset random --random-input-len 256 --random-output-len 64 \
        --num-prompts 200 --request-rate 8 --goodput ttft:500 tpot:50 --json out.json --plot out.png

Errors a user can cause (a bad flag value, an unreadable dataset, no model to name) print one
line to stderr and return 1. A run in which no request succeeds also returns 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fornax.bench import BenchUsageError, workloads
from fornax.bench import client as bench_client
from fornax.bench.client import RequestResult, Target
from fornax.bench.plot import plot_run, plot_sweep
from fornax.bench.report import (
    Summary,
    format_sweep_table,
    format_table,
    parse_goodput,
    run_report,
    summarize,
)

CALIBRATION_WORDS = 400


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` (with its `serve` subcommand) to a parent's subparsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server over HTTP")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve_args(sub.add_parser("serve", help="load-test a running server: TTFT, TPOT, ITL, throughput"))
    return bench


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok)"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name to request (default: first of GET /v1/models)")
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions or /v1/completions",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take in all")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=workloads.DATASETS, default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset sharegpt)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not counted")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument(
        "--random-output-len", type=int, default=128, help="output length for random and prefix-repetition"
    )
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly within +-ratio of the mean",
    )
    d.add_argument("--prefix-len", type=int, default=256)
    d.add_argument("--num-prefixes", type=int, default=4)
    d.add_argument("--suffix-len", type=int, default=32)
    d.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="override the output length of sharegpt / builtin prompts",
    )
    d.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force exactly max_tokens (default: on for random/prefix-repetition, off otherwise)",
    )
    d.add_argument(
        "--tokenize-calibration",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="size random text with the server's POST /tokenize when it has one",
    )
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate", type=float, default=math.inf, help="mean req/s (default inf: all at once)"
    )
    a.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 more regular",
    )
    a.add_argument("--max-concurrency", type=int, default=None, help="at most N requests in flight")
    a.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="N,N,...",
        help="run once per max-concurrency level, e.g. 1,4,16,64",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, keys ttft, tpot, e2el, e.g. ttft:500 tpot:50",
    )
    o.add_argument("--json", default=None, metavar="FILE", help="write summary + per-request results")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="write latency CDFs / sweep chart")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parse_levels(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchUsageError(f"--sweep-concurrency takes integers like 1,4,16; got {text!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise BenchUsageError(f"--sweep-concurrency levels must be >= 1; got {text!r}")
    return levels


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise BenchUsageError("--num-prompts must be at least 1")
    if args.num_warmups < 0:
        raise BenchUsageError("--num-warmups must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchUsageError("--max-concurrency must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        raise BenchUsageError("--timeout must be positive")
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise BenchUsageError("--dataset sharegpt needs --dataset-path FILE.json")
    if args.output_len is not None and args.output_len < 1:
        raise BenchUsageError("--output-len must be at least 1")
    workloads.arrival_offsets(0, args.request_rate, args.burstiness)  # validates rate and burstiness


def build_workload(args: argparse.Namespace, tokens_per_word: float) -> list[workloads.BenchRequest]:
    n, seed = args.num_prompts, args.seed
    if args.dataset == "random":
        reqs = workloads.random_workload(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, seed, tokens_per_word
        )
    elif args.dataset == "prefix-repetition":
        reqs = workloads.prefix_repetition_workload(
            n,
            args.prefix_len,
            args.num_prefixes,
            args.suffix_len,
            args.random_output_len,
            seed,
            tokens_per_word,
        )
    elif args.dataset == "sharegpt":
        reqs = workloads.sharegpt_workload(args.dataset_path, n, seed, args.output_len)
    else:
        reqs = workloads.builtin_workload(n, seed, args.output_len)
    if args.ignore_eos is not None:
        reqs = [dataclasses.replace(r, ignore_eos=args.ignore_eos) for r in reqs]
    return reqs


async def _calibrate(args: argparse.Namespace, base_url: str, model: str) -> float:
    """Tokens per word of the random-text vocabulary: measured by /tokenize, else 1.0."""
    if args.dataset not in ("random", "prefix-repetition") or not args.tokenize_calibration:
        return 1.0
    sample = workloads.random_text(np.random.default_rng(12345), CALIBRATION_WORDS, 1.0)
    tpw = await bench_client.tokens_per_word(base_url, model, args.api_key, sample)
    if tpw is None:
        print("no usable POST /tokenize on the server: assuming 1 token per word", file=sys.stderr)
        return 1.0
    print(f"calibrated with /tokenize: {tpw:.3f} tokens per word", file=sys.stderr)
    return tpw


Run = tuple[int | None, Summary, list[RequestResult]]  # (max concurrency, summary, results)


async def _one_run(
    target: Target,
    reqs: list[workloads.BenchRequest],
    offsets: np.ndarray,
    args: argparse.Namespace,
    concurrency: int | None,
    desc: str,
) -> tuple[list[RequestResult], float]:
    with tqdm(total=len(reqs), desc=desc, disable=args.no_progress, file=sys.stderr, unit="req") as bar:
        return await bench_client.run_load(
            target, reqs, offsets, concurrency, args.timeout, on_done=lambda _r: bar.update(1)
        )


async def _warm_up(target: Target, reqs: list[workloads.BenchRequest], args: argparse.Namespace) -> None:
    if args.num_warmups == 0:
        return
    warm = [reqs[i % len(reqs)] for i in range(args.num_warmups)]
    results, _ = await _one_run(target, warm, np.zeros(len(warm)), args, args.max_concurrency, "warm-up")
    failed = [r for r in results if not r.success]
    if failed:
        print(f"warm-up: {len(failed)}/{len(warm)} failed, e.g. {failed[0].error}", file=sys.stderr)


def _config(args: argparse.Namespace, model: str, base_url: str, tpw: float) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    cfg.pop("api_key", None)  # never write a secret into a report
    cfg.update(
        model=model,
        base_url=base_url,
        tokens_per_word=tpw,
        started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in cfg.items()}


async def _bench(args: argparse.Namespace) -> int:
    base_url = bench_client.normalize_base_url(args.base_url)
    slos = parse_goodput(args.goodput)
    levels = _parse_levels(args.sweep_concurrency)
    _check_args(args)
    model = args.model or await bench_client.fetch_first_model(base_url, args.api_key)
    if not model:
        raise BenchUsageError(f"no --model given and {base_url}/v1/models did not name one")
    tpw = await _calibrate(args, base_url, model)
    reqs = build_workload(args, tpw)
    target = Target(base_url, model, args.endpoint, args.api_key, args.temperature)
    offsets = workloads.arrival_offsets(len(reqs), args.request_rate, args.burstiness, args.seed)
    config = _config(args, model, base_url, tpw)
    await _warm_up(target, reqs, args)

    runs: list[Run] = []
    for conc in levels or [args.max_concurrency]:
        desc = "bench" if conc is None else f"concurrency {conc}"
        results, duration = await _one_run(target, reqs, offsets, args, conc, desc)
        summary = summarize(results, duration, slos)
        runs.append((conc, summary, results))
        title = f"Serving benchmark (rate {args.request_rate:g}/s, max concurrency {conc or 'unlimited'})"
        print(format_table(summary, title=title))
        _print_errors(results)
    if levels:
        print(format_sweep_table([(c or 0, s) for c, s, _ in runs]))
    _write_outputs(args, config, runs, sweep=levels is not None)
    return 0 if any(s.completed for _, s, _ in runs) else 1


def _print_errors(results: list[RequestResult], limit: int = 3) -> None:
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    for msg, count in sorted(errors.items(), key=lambda kv: -kv[1])[:limit]:
        print(f"  {count} failed: {msg}", file=sys.stderr)


def _write_outputs(args: argparse.Namespace, config: dict[str, Any], runs: list[Run], sweep: bool) -> None:
    if args.json:
        if sweep:
            doc: dict[str, Any] = {
                "config": config,
                "levels": [{"max_concurrency": c, **run_report(config, s, res)} for c, s, res in runs],
            }
            for level in doc["levels"]:
                level.pop("config")
        else:
            _, s, res = runs[0]
            doc = run_report(config, s, res)
        Path(args.json).write_text(json.dumps(doc, indent=1, allow_nan=False), encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        title = f"{config['model']} @ {config['base_url']} ({args.dataset}, {args.endpoint})"
        if sweep:
            plot_sweep([(c or 0, s) for c, s, _ in runs], args.plot, title)
        else:
            plot_run(runs[0][2], runs[0][1], args.plot, title)
        print(f"wrote {args.plot}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    """Entry point for `fornax bench ...` once parsed; returns the process exit code."""
    if getattr(args, "bench_command", "serve") != "serve":
        print(f"fornax bench: unknown subcommand {args.bench_command!r}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_bench(args))
    except (ValueError, OSError) as exc:
        print(f"fornax bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fornax bench: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Standalone use: `python -m fornax.bench.cli serve ...` (same flags as `fornax bench serve`)."""
    parser = argparse.ArgumentParser(prog="fornax")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
