"""Dense bf16 matmuls over one model's worth of matrices, by rows per call: torch's linear
(oneDNN) against fornax's native bf16 kernel (kernels/bf16_matmul.c), side by side.

Random bf16 weights in the default model's shapes (30 layers of qkv / o / gate_up / down and
the 49,152-row LM head: ~268 MB, eight times this CPU's L3, so every pass streams the weights
from memory as a decode step does). The two take turns pass by pass; each figure is the
median of 7 passes. Rows are activation rows per call (1: single-stream decode; more:
batched decode or speculative verification). Python's per-call overhead is included for
both (121 calls a pass).

    .venv/bin/python benchmarks/bf16_matmul.py [--rows 1,2,4,8,16,24,32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from quant_matmul import HEAD_SHAPE, LAYER_SHAPES  # benchmarks/ is on sys.path when run as a script

from fornax.layers.native import load_bf16_matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,24,32")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    kernel = load_bf16_matmul()
    if kernel is None:
        raise SystemExit("the native bf16 kernel does not run here (no AVX-512 BF16 or no C compiler)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k).bfloat16() for n, k in LAYER_SHAPES * args.layers + [HEAD_SHAPE]]
    print(f"{'rows':>4}  {'torch ms':>9}  {'native ms':>9}  {'torch / native':>14}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in LAYER_SHAPES}
        runs: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(7):
            for name, fn in (("torch", F.linear), ("native", kernel)):
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                runs[name].append((time.perf_counter() - start) * 1e3)
        t, n = statistics.median(runs["torch"]), statistics.median(runs["native"])
        print(f"{rows:>4}  {t:>9.2f}  {n:>9.2f}  {t / n:>13.2f}x")


if __name__ == "__main__":
    main()
