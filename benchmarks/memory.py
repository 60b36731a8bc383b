"""Resident memory of a serving process, before and after a fixed load, with its breakdown
(engine/memory_report.py), side by side with llama.cpp's server when one is given.

Each server serves the default model's Q4_1 GGUF with the same KV budget (--kv MiB; for
llama-server, the largest f16 context that fits in it as it sizes one: 32 slots of a multiple
of 256 tokens each, so 16,384 tokens, 360 MiB, for 384 MiB) and takes the same load: `fornax
bench serve`, 64 random requests of 128 prompt and 128 output tokens, 32 at a time
(benchmarks/serve_streams.sh's workload). RSS is read from /proc/PID/status when the
server is ready and again 2 s after the load ends; fornax's breakdown from GET /admin/memory.
fornax runs make run's flags (--quantization auto --large-step-quantization w8a8).
Goal (docs/memory.md): fornax's RSS after the load <= 1.3x llama-server's.

    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/memory.py --json memory.json
    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/memory.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _servers import (
    MAKE_RUN_FLAGS,
    Process,
    ServerProcess,
    free_port,
)  # benchmarks/ is on sys.path when run as a script

from fornax.config import DEFAULT_MODEL
from fornax.models.registry import resolve_model

FORNAX_FLAGS = [
    *MAKE_RUN_FLAGS,
    "--max-num-seqs",
    "64",
    "--no-access-log",
    "--log-level",
    "warning",
]
ADMIN_KEY = "sk-memory-admin"
LLAMA_SLOTS = 32  # -np: one slot per concurrent stream of the load
GOAL = 1.3
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def load(url: str, out: Path, api_key: str | None) -> float:
    """The fixed load; its output tok/s."""
    cmd = [
        sys.executable,
        "-m",
        "fornax.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--dataset",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "128",
        "--num-prompts",
        "64",
        "--num-warmups",
        "2",
        "--max-concurrency",
        "32",
        "--seed",
        "0",
        "--no-progress",
        "--json",
        str(out),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed"] == 0, "requests failed"
    return float(summary["output_throughput"])


def breakdown(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/memory", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0)
    r.raise_for_status()
    return r.json()


def measure_fornax(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    kv = ["--kv-cache-memory", f"{args.kv}MiB"]
    server = Process("fornax", ["serve", args.model, *kv, "--admin-key", ADMIN_KEY, *FORNAX_FLAGS], log_dir)
    try:
        server.wait_ready(lambda r: r.status_code == 200)
        before, parts_before = rss_bytes(server.proc.pid), breakdown(server.url)
        tok_s = load(server.url, log_dir / "fornax-bench.json", ADMIN_KEY)
        time.sleep(2.0)
        after, parts_after = rss_bytes(server.proc.pid), breakdown(server.url)
    finally:
        server.stop()
    return {
        "rss_before": before,
        "rss_after": after,
        "output_tok_s": tok_s,
        "breakdown_before": parts_before,
        "breakdown_after": parts_after,
    }


def llama_kv_bytes_per_token(gguf: Path) -> int:
    """f16 K and V of one token over all layers."""
    from fornax.models.loader import gguf_model_config, read_gguf

    c = gguf_model_config(read_gguf(gguf).metadata, name=gguf.stem)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2


def llama_context(gguf: Path, kv_bytes: int, slots: int) -> int:
    """Tokens of f16 K and V that fit in kv_bytes, as llama-server sizes them: each of its
    `slots` gets n_ctx / slots, padded up to a multiple of 256 (a -c between two such sizes
    is rounded up to the next, e.g. -c 17408 with 32 slots became 24,576 tokens)."""
    per_token = llama_kv_bytes_per_token(gguf)
    step = 256 * slots
    return kv_bytes // per_token // step * step


def measure_llama(args: argparse.Namespace, gguf: Path, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = llama_context(gguf, args.kv * MiB, LLAMA_SLOTS)
    cmd = [
        args.llama_server,
        "-m",
        str(gguf),
        "-np",
        str(LLAMA_SLOTS),
        "-c",
        str(ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    server = ServerProcess("llama-server", cmd, port, log_dir / "llama-server.log")
    try:
        server.wait_ready()
        before = rss_bytes(server.proc.pid)
        tok_s = load(url, log_dir / "llama-bench.json", None)
        time.sleep(2.0)
        after = rss_bytes(server.proc.pid)
    finally:
        server.stop()
    kv = ctx * llama_kv_bytes_per_token(gguf)
    return {
        "rss_before": before,
        "rss_after": after,
        "output_tok_s": tok_s,
        "context_tokens": ctx,
        "kv_bytes": kv,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--kv", type=int, default=384, help="KV budget in MiB, both servers")
    p.add_argument("--llama-server", default=None, help="a llama-server binary to measure side by side")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gguf = resolve_model(args.model).gguf_path
    assert gguf is not None, "a GGUF model (llama-server reads only those)"
    result: dict[str, Any] = {"model": gguf.name, "kv_mib": args.kv}
    with tempfile.TemporaryDirectory() as tmp:
        result["fornax"] = measure_fornax(args, Path(tmp))
        if args.llama_server:
            result["llama_server"] = measure_llama(args, gguf, Path(tmp))
    rows = [("fornax serve", result["fornax"])]
    if args.llama_server:
        rows.append(("llama-server", result["llama_server"]))
    print(f"{'server':<14} {'RSS ready MiB':>14} {'RSS after MiB':>14} {'output tok/s':>13}")
    for name, r in rows:
        before, after_load = r["rss_before"] / MiB, r["rss_after"] / MiB
        print(f"{name:<14} {before:14.1f} {after_load:14.1f} {r['output_tok_s']:13.1f}")
    print("\nfornax after the load, by owner (MiB):")
    after = result["fornax"]["breakdown_after"]
    for owner, n in after["owners"].items():
        print(f"  {n / MiB:8.1f}  {owner}")
    print(f"  {after['unattributed_bytes'] / MiB:8.1f}  unattributed")
    if args.llama_server:
        llama = result["llama_server"]
        kv_mib = llama["kv_bytes"] / MiB
        print(
            f"\nllama-server: -c {llama['context_tokens']}, an f16 KV cache of {kv_mib:.1f} MiB "
            f"(fornax: {args.kv} MiB)"
        )
        ratio = result["fornax"]["rss_after"] / result["llama_server"]["rss_after"]
        result["ratio_after"] = ratio
        print(f"\nRSS after the load, fornax / llama-server: {ratio:.2f}x (goal <= {GOAL}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
