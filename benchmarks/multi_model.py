"""Two models in one process, both busy: their engines on one shared engine thread (how
`fornax serve --model A --model B` runs them) against a thread per engine, in one run.

Each round sends `--streams` concurrent requests of `--tokens` tokens to each model at once
and times until all are done; the arrangements alternate for `--rounds` rounds and the
medians of the total generated tokens per second are printed. With a thread per engine,
each thread runs its own OpenMP team over all the cores (torch.get_num_threads()); with one
shared thread, the engines take turns step by step and there is one team.

    .venv/bin/python benchmarks/multi_model.py [--models smollm2-135m-instruct,gemma3-270m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from fornax.config import EngineConfig, SchedulerConfig
from fornax.engine.async_engine import AsyncEngine, EngineThread
from fornax.engine.request import SamplingParams


async def round_trip(engines: list[AsyncEngine], streams: int, tokens: int, tag: str) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(engine: AsyncEngine, i: int) -> int:
        ids = engine.tokenizer.encode(f"{tag} {i}: tell me a story about the sea.")
        n = 0
        async for out in engine.generate(f"{tag}-{id(engine)}-{i}", ids, params):
            n += len(out.new_token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(e, i) for e in engines for i in range(streams)))
    return sum(counts) / (time.perf_counter() - start)


def build(names: list[str]) -> list[AsyncEngine]:
    """Each engine built in a thread that ends (as the server loads models: server/app.py)."""
    engines: list[AsyncEngine] = []
    for name in names:
        config = EngineConfig(
            model=name,
            quantization="auto",
            large_step_quantization="w8a8",
            scheduler=SchedulerConfig(max_model_len=2048),
        )
        t = threading.Thread(
            target=lambda c=config: engines.append(AsyncEngine.from_config(c, progress=False))
        )
        t.start()
        t.join()
    return engines


async def main_async(args: argparse.Namespace) -> None:
    names = args.models.split(",")
    loop = asyncio.get_running_loop()
    results: dict[str, list[float]] = {"shared thread": [], "thread per engine": []}
    for r in range(args.rounds):
        for arrangement, values in results.items():
            engines = build(names)
            shared = EngineThread() if arrangement == "shared thread" else None
            for e in engines:
                e.start(loop, shared)
            await round_trip(engines, 1, 4, "warm")
            values.append(await round_trip(engines, args.streams, args.tokens, f"r{r}"))
            for e in engines:
                e.stop()
            if shared is not None:
                shared.stop()
    print(
        f"{len(names)} models ({', '.join(names)}), {args.streams} streams each, {args.tokens} tokens per request"
    )
    base = statistics.median(results["shared thread"])
    for arrangement, values in results.items():
        m = statistics.median(values)
        print(
            f"{arrangement:<18} {m:8.1f} tokens/s  ({m / base:.2f}x)  rounds: "
            + ", ".join(f"{v:.1f}" for v in values)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
