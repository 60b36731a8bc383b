"""Dense bf16 matmuls over one model's worth of matrices, by rows per call: torch's linear
(oneDNN) against fornax's native bf16 kernel (kernels/bf16_matmul.c) and, where the CPU has
AMX, the AMX kernel of deterministic mode (kernels/amx_matmul.c), side by side. With
`--dtype float32`: float32 weights, torch's linear (MKL) against kernels/f32_matmul.c.

Random bf16 weights in the default model's shapes (30 layers of qkv / o / gate_up / down and
the 49,152-row LM head: ~268 MB, eight times this CPU's L3, so every pass streams the weights
from memory as a decode step does). The two take turns pass by pass; each figure is the
median of 7 passes. Rows are activation rows per call (1: single-stream decode; more:
batched decode or speculative verification). Python's per-call overhead is included for
both (121 calls a pass).

    .venv/bin/python benchmarks/bf16_matmul.py [--rows 1,2,4,8,16,24,32]
    .venv/bin/python benchmarks/bf16_matmul.py --rows 1,16,64,128,512   # deterministic mode's forms
    .venv/bin/python benchmarks/bf16_matmul.py --dtype float32 --rows 1,4,8,16,24,32,48
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from quant_matmul import HEAD_SHAPE, LAYER_SHAPES  # benchmarks/ is on sys.path when run as a script

from fornax.layers.linear import AmxBf16
from fornax.layers.native import load_amx_bf16_matmul, load_bf16_matmul, load_f32_matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,24,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = load_bf16_matmul() if dtype == torch.bfloat16 else load_f32_matmul()
    if kernel is None:
        raise SystemExit(
            f"the native {args.dtype} kernel does not run here (no C compiler, or no such kernel)"
        )
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for n, k in LAYER_SHAPES * args.layers + [HEAD_SHAPE]]
    amx = load_amx_bf16_matmul() if dtype == torch.bfloat16 else None
    packed = [AmxBf16(w, amx) for w in weights] if amx is not None else []
    sides = {"torch": (F.linear, weights), "native": (kernel, weights)}
    if packed:
        sides["amx"] = (lambda x, form: form(x), packed)
    header = f"{'rows':>4}  {'torch ms':>9}  {'native ms':>9}  {'torch / native':>14}"
    print(header + (f"  {'amx ms':>9}  {'torch / amx':>11}" if packed else ""))
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in LAYER_SHAPES}
        runs: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(7):
            for name, (fn, ws) in sides.items():
                start = time.perf_counter()
                for w in ws:
                    fn(xs[_width(w)], w)
                runs[name].append((time.perf_counter() - start) * 1e3)
        t, n = statistics.median(runs["torch"]), statistics.median(runs["native"])
        line = f"{rows:>4}  {t:>9.2f}  {n:>9.2f}  {t / n:>13.2f}x"
        if packed:
            a = statistics.median(runs["amx"])
            line += f"  {a:>9.2f}  {t / a:>10.2f}x"
        print(line)


def _width(w: torch.Tensor | AmxBf16) -> int:
    """A weight's input width, dense [N, K] or tile-packed."""
    return w.packed.shape[1] * 32 if isinstance(w, AmxBf16) else w.shape[1]


if __name__ == "__main__":
    main()
