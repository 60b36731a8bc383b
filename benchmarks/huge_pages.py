"""What huge pages (layers/hugepages.py) buy a step, in one process: the same work on plain
torch allocations and on huge-page mappings, taking turns pass by pass.

  weights    fornax's int8 x int8 matmuls over the default model's matrices (30 layers of
             qkv / o / gate_up / down and the LM head, random weights), from memory; plain:
             one torch tensor per matrix, huge: all packed into one mapping (hugepages.pack)
  attention  one decode step's paged attention over 30 layers' K/V pools of 4,096 blocks
             (SmolLM2-135M's head layout), each sequence's blocks scattered over the pool,
             16 MiB of other memory traffic between layers (as a step's weights would be);
             plain: torch.empty pools, huge: hugepages.empty

Each figure is the median of 15 passes, in ms per pass (30 layers).

    .venv/bin/python benchmarks/huge_pages.py [--rows 1,8,32,128] [--attention 1x2048,32x256,32x1024]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable

import torch
from quant_matmul import HEAD_SHAPE, LAYER_SHAPES  # benchmarks/ is on sys.path when run as a script

from fornax.layers import hugepages
from fornax.layers.attention import SeqSpan, build_attention_metadata, paged_attention
from fornax.layers.kv_pool import LayerKV
from fornax.layers.linear import Int8Rotated
from fornax.layers.native import load_int8_matmul, load_paged_attention

LAYERS, HEADS, KV_HEADS, DIM, BLOCK, POOL_BLOCKS = 30, 9, 3, 64, 16, 4096


def side_by_side(label: str, passes: dict[str, Callable[[], float]]) -> None:
    """Median ms of each of two passes (they take turns), and the first / the second."""
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(15):
        for name, run in passes.items():
            times[name].append(run())
    (a, ta), (b, tb) = ((n, statistics.median(t)) for n, t in times.items())
    print(f"{label:<26} {a} {ta:8.2f} ms   {b} {tb:8.2f} ms   {a} / {b} {ta / tb:5.2f}x", flush=True)


def weights_case(rows: int, forms: dict[str, list[Int8Rotated]]) -> None:
    shapes = LAYER_SHAPES * LAYERS + [HEAD_SHAPE]
    inputs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}

    def run(mods: list[Int8Rotated]) -> float:
        start = time.perf_counter()
        for m, (_, k) in zip(mods, shapes):
            m(inputs[k])
        return (time.perf_counter() - start) * 1e3

    side_by_side(f"weights, {rows} rows", {name: lambda m=mods: run(m) for name, mods in forms.items()})


def attention_case(
    batch: int, context: int, kernel, variants: Callable[[tuple[int, int, int]], dict[str, list[LayerKV]]]
) -> None:
    """variants(pool shape) -> two named sets of LAYERS pools, timed in turns."""
    rng = random.Random(batch * 100003 + context)
    lengths = [rng.randint(max(1, context // 2), context) for _ in range(batch)]
    free = list(range(1, POOL_BLOCKS))
    rng.shuffle(free)
    spans = [SeqSpan(n - 1, 1, [free.pop() for _ in range(-(-n // BLOCK))]) for n in lengths]
    meta = build_attention_metadata(spans, BLOCK, kernel=kernel)
    pools = variants((POOL_BLOCKS * BLOCK, KV_HEADS, DIM))
    q, k, v = (torch.randn(batch, h, DIM).bfloat16() for h in (HEADS, KV_HEADS, KV_HEADS))
    traffic = torch.zeros(4 << 20)

    def run(layers: list[LayerKV]) -> float:
        total = 0.0
        for pool in layers:
            traffic.add_(1.0)
            start = time.perf_counter()
            paged_attention(q, k, v, pool, meta, DIM**-0.5)
            total += time.perf_counter() - start
        return total * 1e3

    with torch.inference_mode():
        side_by_side(f"attention, {batch} x {context}", {n: lambda p=p: run(p) for n, p in pools.items()})


def plain_and_huge_pools(shape: tuple[int, int, int]) -> dict[str, list[LayerKV]]:
    def pools(alloc) -> list[LayerKV]:
        return [
            LayerKV(alloc(shape, torch.bfloat16).normal_(), alloc(shape, torch.bfloat16).normal_())
            for _ in range(LAYERS)
        ]

    return {"plain": pools(lambda s, d: torch.empty(s, dtype=d)), "huge": pools(hugepages.empty)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--attention", default="1x2048,32x256,32x1024", help="batch x context cases")
    args = ap.parse_args()
    int8, attention = load_int8_matmul(), load_paged_attention()
    if int8 is None or attention is None:
        raise SystemExit("the native kernels do not run here (no AVX-512 VNNI or no C compiler)")
    if not hugepages.HUGE_PAGES_USABLE:
        raise SystemExit("transparent huge pages are not usable here: nothing to compare")
    torch.manual_seed(0)
    plain = [
        Int8Rotated((torch.randn(n, k) * 0.05).bfloat16(), int8)
        for n, k in LAYER_SHAPES * LAYERS + [HEAD_SHAPE]
    ]
    huge = [copy.copy(m) for m in plain]
    packed = hugepages.pack([t for m in huge for t in (m.packed, m.colsum, m.scale)])
    for i, m in enumerate(huge):
        m.packed, m.colsum, m.scale = packed[3 * i : 3 * i + 3]
    for rows in map(int, args.rows.split(",")):
        weights_case(rows, {"plain": plain, "huge": huge})
    for case in args.attention.split(","):
        batch, context = map(int, case.split("x"))
        attention_case(batch, context, attention, plain_and_huge_pools)


if __name__ == "__main__":
    main()
