"""The native int4/int8 matmuls over one model's worth of matrices, by rows per call.

Random weights in the default model's shapes (30 layers of qkv / o / gate_up / down as
BlockInt4, the 49,152-row LM head as BlockInt8: ~96 MB, three times this CPU's L3, so every
pass streams the weights from memory as a decode step does). Each figure is the median of 7
passes; the rows are activation rows per call (1: single-stream decode; more: batched decode
or speculative verification). Python's per-call overhead (~10 us a call, 121 calls) is
included, as in the op-by-op path; the one-call step pays it once.

    .venv/bin/python benchmarks/quant_matmul.py [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fornax.layers.linear import BlockInt4, BlockInt8
from fornax.layers.native import load_quant_matmul

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    kernel = load_quant_matmul()
    if kernel is None:
        raise SystemExit("the native integer kernels do not run here (no AVX-512 VNNI or no C compiler)")
    torch.manual_seed(0)
    layers = [BlockInt4(torch.randn(n, k) * 0.05, kernel) for n, k in LAYER_SHAPES * args.layers]
    head = BlockInt8(torch.randn(*HEAD_SHAPE) * 0.05, kernel)
    print(f"{'rows':>4}  {'layers ms':>9}  {'LM head ms':>10}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in LAYER_SHAPES}}
        layer_ms, head_ms = [], []
        for _ in range(7):
            start = time.perf_counter()
            for form in layers:
                form(xs[form.m.shape[1] * 32])
            mid = time.perf_counter()
            head(xs[HEAD_SHAPE[1]])
            layer_ms.append((mid - start) * 1e3)
            head_ms.append((time.perf_counter() - mid) * 1e3)
        print(f"{rows:>4}  {statistics.median(layer_ms):>9.2f}  {statistics.median(head_ms):>10.2f}")


if __name__ == "__main__":
    main()
