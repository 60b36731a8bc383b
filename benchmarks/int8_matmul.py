"""int8 x int8 matmuls over one model's worth of matrices, by rows per call, side by side with
the other forms a step can take: torch's bf16 linear (oneDNN), the native bf16 kernel, the
native int4 kernel (weight-only), fornax's int8 x int8 kernel (kernels/int8_matmul.c, the
activations rotated and rounded in the same call), and torch._int_mm (oneDNN's int8 product
alone, on activations already int8: a lower bound for an int8 path through torch, which would
still have to round the activations and scale its int32 sums back).

Random weights in the default model's shapes (30 layers of qkv / o / gate_up / down and the
LM head; from memory, as in a step). The forms take turns pass by pass; each figure is the
median of 7 passes, Python's per-call overhead included.

    .venv/bin/python benchmarks/int8_matmul.py [--rows 1,4,8,16,32,64,128,512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from quant_matmul import HEAD_SHAPE, LAYER_SHAPES  # benchmarks/ is on sys.path when run as a script

from fornax.layers.kernel_plan import DENSE_BF16_MAX_ROWS
from fornax.layers.linear import BlockInt4, DenseBf16, Int8Rotated
from fornax.layers.native import load_bf16_matmul, load_int8_matmul, load_quant_matmul


def forms(args: argparse.Namespace) -> dict[str, list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]]:
    """name -> [(input width, the call)] for every matrix of the model."""
    bf16, int4, int8 = load_bf16_matmul(), load_quant_matmul(), load_int8_matmul()
    if int8 is None:
        raise SystemExit("the int8 x int8 kernel does not run here (no AVX-512 VNNI or no C compiler)")
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [HEAD_SHAPE]
    weights = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
    out: dict[str, list] = {"torch bf16": [(w.shape[1], lambda x, w=w: F.linear(x, w)) for w in weights]}
    if bf16 is not None:
        out["native bf16"] = [(w.shape[1], DenseBf16(w, bf16)) for w in weights]
    if int4 is not None:
        out["native int4"] = [(w.shape[1], BlockInt4(w, int4)) for w in weights]
    out["int8 x int8"] = [(w.shape[1], Int8Rotated(w, int8)) for w in weights]
    int_mm = [torch.randint(-127, 128, (w.shape[1], w.shape[0]), dtype=torch.int8) for w in weights]
    out["torch._int_mm"] = [(-w.shape[0], lambda q, w=w: torch._int_mm(q, w)) for w in int_mm]  # int8 input
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    table = forms(args)
    print(
        f"{'rows':>4}  "
        + "  ".join(f"{name:>13}" for name in table)
        + "   (ms per pass; ratios: vs int8 x int8)"
    )
    for rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).bfloat16() for _, k in LAYER_SHAPES + [HEAD_SHAPE]}
        inputs.update(
            {
                -k: torch.randint(-127, 128, (rows, k), dtype=torch.int8)
                for _, k in LAYER_SHAPES + [HEAD_SHAPE]
            }
        )
        names = [n for n in table if not (n.startswith("native") and rows > DENSE_BF16_MAX_ROWS)]
        runs: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(7):
            for name in names:
                start = time.perf_counter()
                for width, fn in table[name]:
                    fn(inputs[width])
                runs[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(v) for name, v in runs.items()}
        base = med["int8 x int8"]
        cells = [f"{med[n]:>7.2f} {med[n] / base:>4.2f}x" if n in med else f"{'-':>13}" for n in table]
        print(f"{rows:>4}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
