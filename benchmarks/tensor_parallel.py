"""What tensor parallelism costs and buys on this machine: the default model served offline by
LLM with tensor_parallel_size 1 (both cores in one process) and 2 (one core per rank), side by
side, alternating; and the time of one gloo all-reduce of a step's hidden states between two
processes, by rows.

Prints single-stream decode tok/s, an 8-request batch's output tok/s and a 512-token prefill's
tok/s for each size (medians over rounds), and microseconds per all-reduce.

    .venv/bin/python benchmarks/tensor_parallel.py --rounds 3 [--deterministic]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

from fornax import LLM, SamplingParams
from fornax.models.sharding import connect_gloo_groups, gloo_all_reduce

HIDDEN = 576  # the default model's hidden size
PROMPT = "Write a long story about a lighthouse keeper and a storm. " * 3


def _engine_figures(llm: LLM) -> dict[str, float]:
    """tok/s of one stream's decode, an 8-request batch, and a 512-token prefill."""
    figures = {}
    t = time.perf_counter()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    figures["decode 1 stream"] = len(out.outputs[0].token_ids) / (time.perf_counter() - t)
    prompts = [PROMPT + str(i) for i in range(8)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    figures["8 requests"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    ids = list(range(1000, 1512))
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1))
    figures["prefill 512"] = 512 / (time.perf_counter() - t)
    return figures


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reduce_rank(rank: int, port: int, rows: list[int], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    reduce = gloo_all_reduce(connect_gloo_groups(f"tcp://127.0.0.1:{port}", rank, 2, 60)[0])
    for n in rows:
        t = torch.randn(n, HIDDEN).bfloat16()
        for _ in range(20):  # warm-up
            reduce(t)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            reduce(t)
            times.append(time.perf_counter() - start)
        if rank == 0:
            out.put((n, statistics.median(times) * 1e6))


def _all_reduce_us(rows: list[int]) -> list[tuple[int, float]]:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_reduce_rank, args=(r, port, rows, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in rows]
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="both sizes in deterministic mode (TP's exact layout: two gathers per projection)",
    )
    args = ap.parse_args()
    # no prefix cache: every round computes its prompts again
    engines = {
        size: LLM(
            progress=False,
            tensor_parallel_size=size,
            enable_prefix_caching=False,
            deterministic=args.deterministic,
        )
        for size in (1, 2)
    }
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for round_ in range(args.rounds):
        for size in (1, 2) if round_ % 2 == 0 else (2, 1):
            torch.set_num_threads(2 if size == 1 else 1)  # the engine process's share of the cores
            runs[size].append(_engine_figures(engines[size]))
    print(f"{'tok/s':>16}  {'TP=1':>8}  {'TP=2':>8}  {'TP=2 / TP=1':>11}")
    for key in runs[1][0]:
        one = statistics.median(r[key] for r in runs[1])
        two = statistics.median(r[key] for r in runs[2])
        print(f"{key:>16}  {one:>8.1f}  {two:>8.1f}  {two / one:>10.2f}x")
    print(
        f"\n{'rows':>5}  {'bf16 all-reduce, us':>20}  (2 processes, gloo over loopback; 2 per layer per step)"
    )
    for n, us in _all_reduce_us([1, 8, 32, 512]):
        print(f"{n:>5}  {us:>20.1f}")


if __name__ == "__main__":
    main()
