"""Embedding speed: fornax against sentence-transformers in one process, and `fornax serve`
against llama.cpp's `llama-server --embedding`, on the same model (all-MiniLM-L6-v2), the same
texts and the same CPU threads, in one run.

    .venv/bin/python benchmarks/embeddings.py                     # in-process, both libraries
    .venv/bin/python benchmarks/embeddings.py --llama-server      # and both servers (llama.cpp
                                                                  # built by vs_llama_cpp.py)

What it measures, for batches of 1 and of 32 texts (each batch one call, or one HTTP request):
texts/s over all batches and the p50 latency of one batch. Rounds alternate the order of the
contenders (the machine drifts within a run); the figures are medians over rounds. Both
in-process contenders run float32 with the same thread count (torch.set_num_threads), the
sentence-transformers one with `encode(batch_size=len(batch), normalize_embeddings=True)`;
llama.cpp gets the same model converted by its own convert_hf_to_gguf.py (float32, mean pooling).
Each run first checks that fornax's vectors agree with the reference's (cosine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from _servers import Process, ServerProcess, free_port  # benchmarks/ is on sys.path when run as a script

MODEL = "all-minilm-l6-v2"
CACHE_ROOT = Path.home() / ".cache" / "fornax-bench"
WORDS = (
    "inference serving batch token cache prompt decode model weights kernel memory thread "
    "request latency throughput vector search document query answer"
).split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 8-60 words: the lengths retrieval chunks and queries have."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))) for _ in range(n)]


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def timed(embed: Callable[[list[str]], Any], groups: list[list[str]]) -> dict[str, float]:
    """texts/s over all groups and p50 seconds of one group, one call per group."""
    latencies = []
    start = time.perf_counter()
    for group in groups:
        t0 = time.perf_counter()
        embed(group)
        latencies.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    return {"texts_per_s": sum(map(len, groups)) / total, "p50_s": statistics.median(latencies)}


def model_dir() -> Path:
    from fornax.models.registry import resolve_model

    resolved = resolve_model(MODEL)
    assert resolved.hf_dir is not None
    return resolved.hf_dir


def in_process(
    texts: list[str], sizes: list[int], rounds: int, threads: int
) -> dict[str, dict[int, list[dict]]]:
    import torch
    from sentence_transformers import SentenceTransformer

    from fornax import LLM

    torch.set_num_threads(threads)
    llm = LLM(MODEL, dtype="float32", num_threads=threads, progress=False)
    reference = SentenceTransformer(str(model_dir()), device="cpu")
    torch.set_num_threads(threads)
    ours = [o.embedding for o in llm.embed(texts[:32])]
    theirs = reference.encode(texts[:32], normalize_embeddings=True)
    worst = min(sum(a * float(b) for a, b in zip(x, y)) for x, y in zip(ours, theirs))
    print(f"agreement on 32 texts: min cosine {worst:.7f}", flush=True)

    def sentence_transformers(group: list[str]) -> Any:
        return reference.encode(group, batch_size=len(group), normalize_embeddings=True)

    contenders = {"fornax": llm.embed, "sentence-transformers": sentence_transformers}
    return _rounds(contenders, texts, sizes, rounds)


def _rounds(
    contenders: dict[str, Callable[[list[str]], Any]], texts: list[str], sizes: list[int], rounds: int
) -> dict[str, dict[int, list[dict]]]:
    results: dict[str, dict[int, list[dict]]] = {name: {s: [] for s in sizes} for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for size in sizes:
            for name in order:
                embed = contenders[name]
                embed(texts[:size])  # warm-up
                results[name][size].append(timed(embed, batches(texts, size)))
    return results


def llama_gguf(llama: dict[str, Any], out: Path) -> Path:
    """all-MiniLM-L6-v2 as a float32 GGUF, by llama.cpp's own converter (once)."""
    gguf = out / "all-minilm-l6-v2.f32.gguf"
    if gguf.exists():
        return gguf
    src = Path(llama["src_dir"])
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    cmd = [
        sys.executable,
        str(src / "convert_hf_to_gguf.py"),
        str(model_dir()),
        "--outtype",
        "f32",
        "--outfile",
        str(gguf),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"converting to GGUF failed:\n{done.stderr[-2000:]}")
    return gguf


def servers(
    texts: list[str], sizes: list[int], rounds: int, threads: int, llama_cache: Path, log_dir: Path
) -> dict[str, dict[int, list[dict]]]:
    llama = json.loads((llama_cache / "build-info.json").read_text())
    gguf = llama_gguf(llama, llama_cache.parent)
    fornax = Process(
        "fornax",
        [
            "serve",
            "--model",
            MODEL,
            "--dtype",
            "float32",
            "--num-threads",
            str(threads),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        log_dir,
    )
    port = free_port()
    cmd = [
        str(Path(llama["bin_dir"]) / "llama-server"),
        "-m",
        str(gguf),
        "--embedding",
        "--pooling",
        "mean",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        "8192",
        "-b",
        "8192",
        "-ub",
        "8192",
        "-np",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    llama_server = ServerProcess("llama-server", cmd, port, log_dir / "llama-server.log")
    try:
        fornax.wait_ready()
        llama_server.wait_ready()
        client = httpx.Client(timeout=300)

        def post(url: str) -> Callable[[list[str]], Any]:
            def embed(group: list[str]) -> Any:
                r = client.post(url + "/v1/embeddings", json={"model": MODEL, "input": group})
                r.raise_for_status()
                return r.json()

            return embed

        return _rounds(
            {"fornax serve": post(fornax.url), "llama-server": post(llama_server.url)}, texts, sizes, rounds
        )
    finally:
        fornax.stop()
        llama_server.stop()


def table(results: dict[str, dict[int, list[dict]]]) -> str:
    lines = ["| contender | batch | texts/s | p50 ms | fornax / it |", "| --- | --- | --- | --- | --- |"]
    ours = "fornax" if "fornax" in results else "fornax serve"
    for name, by_size in results.items():
        for size, runs in by_size.items():
            tps = statistics.median(r["texts_per_s"] for r in runs)
            p50 = statistics.median(r["p50_s"] for r in runs) * 1000
            mine = statistics.median(r["texts_per_s"] for r in results[ours][size])
            ratio = "" if name == ours else f"{mine / tps:.2f}x"
            lines.append(f"| {name} | {size} | {tps:.1f} | {p50:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=256, help="texts per measurement")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--llama-server", action="store_true", help="also fornax serve vs llama-server")
    p.add_argument(
        "--llama-cache",
        type=Path,
        default=CACHE_ROOT / "llama.cpp-0.3.36-avx2",
        help="a llama.cpp build of benchmarks/vs_llama_cpp.py (its build-info.json)",
    )
    args = p.parse_args()
    texts = make_texts(args.texts)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    print(
        f"{args.texts} texts, batches of {sizes}, {args.rounds} rounds, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC",
        flush=True,
    )
    print(table(in_process(texts, sizes, args.rounds, args.threads)), flush=True)
    if args.llama_server:
        with tempfile.TemporaryDirectory(prefix="fornax-embed-") as tmp:
            print(
                table(servers(texts, sizes, args.rounds, args.threads, args.llama_cache, Path(tmp))),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
