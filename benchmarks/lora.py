"""LoRA serving cost: the default model with four adapters in the request mix against the base
model alone, through `fornax serve` with make run's flags, in one run.

    .venv/bin/python benchmarks/lora.py                 # 1 and 16 streams, 3 rounds
    .venv/bin/python benchmarks/lora.py --streams 16 --rounds 5 --rank 16

Two servers on the same model and flags: one plain, one with `--lora` x4 (random adapters of
rank `--rank` on every target: q/k/v/o and gate/up/down, the costliest case; random weights cost
what trained ones do). Each round measures both, alternating which goes first (the machine
drifts within a run), at each stream count: a warm-up, then 2x`streams` streaming completions of
128 greedy tokens, `streams` at a time, the adapter server's requests round-robin over its four
adapters. Only one server works at a time. Figures: medians of output tok/s over rounds, and
the ratio adapters / base (docs/lora.md; goals in the LoRA issue: >= 0.9 at 1 stream, >= 0.85 at 16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__:  # imported as benchmarks.lora (tests/model/test_lora.py writes adapters with it)
    from benchmarks._servers import MAKE_RUN_FLAGS, Process
else:  # run as a script: benchmarks/ is on sys.path
    from _servers import MAKE_RUN_FLAGS, Process

OUTPUT_TOKENS = 128
ADAPTERS = 4


def write_random_adapter(out: Path, config: Any, rank: int, seed: int, scale: float = 0.02) -> None:
    """A random PEFT adapter of `config`'s shapes (a fornax ModelConfig) on every target, written as
    peft writes one (no peft needed: a GGUF model is nothing peft can wrap)."""
    import torch
    from safetensors.torch import save_file

    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = scale * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{key}.lora_B.weight"] = scale * torch.randn(fan_out, rank, generator=gen)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted(m.rsplit(".", 1)[1] for m in shapes)
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(config_json))


def write_adapters(out: Path, rank: int) -> list[tuple[str, Path]]:
    """ADAPTERS random adapters of the default model, every target."""
    from fornax.config import DEFAULT_MODEL
    from fornax.models.loader import gguf_model_config, read_gguf
    from fornax.models.registry import resolve_model

    gguf = resolve_model(DEFAULT_MODEL).gguf_path
    assert gguf is not None
    config = gguf_model_config(read_gguf(gguf).metadata)
    made = []
    for n in range(ADAPTERS):
        write_random_adapter(out / f"adapter{n}", config, rank, seed=n)
        made.append((f"adapter{n}", out / f"adapter{n}"))
    return made


def requests(seed: int, n: int, output_len: int) -> list[Any]:
    import numpy as np

    from fornax.bench.workloads import BenchRequest, random_text

    rng = np.random.default_rng(seed)
    return [
        BenchRequest(random_text(rng, int(rng.integers(30, 301)), 1.0), 0, output_len, True) for _ in range(n)
    ]


async def measure(url: str, models: list[str], streams: int, seed: int) -> float:
    """Output tok/s of 2x`streams` requests, `streams` at a time, round-robin over `models`."""
    from fornax.bench.client import Target, make_client, send_request
    from fornax.bench.report import summarize

    targets = [Target(url, m, endpoint="completions") for m in models]

    async def load(reqs: list[Any]) -> tuple[list[Any], float]:
        sem = asyncio.Semaphore(streams)
        async with make_client(streams, 600.0) as client:
            start = asyncio.get_running_loop().time()

            async def one(i: int) -> Any:
                async with sem:
                    return await send_request(client, targets[i % len(targets)], reqs[i], i, 0.0, 600.0)

            results = await asyncio.gather(*(one(i) for i in range(len(reqs))))
            return results, asyncio.get_running_loop().time() - start

    await load(requests(seed, streams, 8))  # warm-up: every adapter in a slot, the pools touched
    results, duration = await load(requests(seed + 1, 2 * streams, OUTPUT_TOKENS))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return summarize(results, duration).output_throughput


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,16", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    stream_counts = [int(s) for s in args.streams.split(",")]
    from fornax.config import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = write_adapters(root / "adapters", args.rank)
        lora_flags = [f for name, path in adapters for f in ("--lora", f"{name}={path}")]
        lora_flags += ["--max-loras", str(ADAPTERS), "--max-lora-rank", str(args.rank)]
        servers = {
            "base": (Process("base", ["serve", DEFAULT_MODEL, *MAKE_RUN_FLAGS], root), [DEFAULT_MODEL]),
            "adapters": (
                Process("adapters", ["serve", DEFAULT_MODEL, *MAKE_RUN_FLAGS, *lora_flags], root),
                [name for name, _ in adapters],
            ),
        }
        figures: dict[str, dict[int, list[float]]] = {k: {s: [] for s in stream_counts} for k in servers}
        try:
            for server, _ in servers.values():
                server.wait_ready()
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for streams in stream_counts:
                    for name in order:
                        server, models = servers[name]
                        tok_s = asyncio.run(measure(server.url, models, streams, seed=1000 * r + streams))
                        figures[name][streams].append(tok_s)
                        print(f"round {r + 1} {name:8s} {streams:3d} streams: {tok_s:7.1f} tok/s", flush=True)
        finally:
            for server, _ in servers.values():
                server.stop()
    print(
        f"\n{cpu_model()}; rank {args.rank}, {ADAPTERS} adapters, medians of "
        f"{args.rounds} rounds (output tok/s)"
    )
    for streams in stream_counts:
        base = statistics.median(figures["base"][streams])
        mixed = statistics.median(figures["adapters"][streams])
        print(f"{streams:3d} streams: base {base:7.1f}  adapters {mixed:7.1f}  ratio {mixed / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
