"""Matmul kernels at the default model's shapes, per number of rows (tokens in a step).

Times bf16 (oneDNN), weight-only int8 and int4,
side by side in one run; the crossover picks `small_step_max_rows`.

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import median_ms  # benchmarks/ is on sys.path when run as a script

from fornax.layers.linear import SMALL_STEP_METHODS

# (out, in) of the fused QKV, O, fused gate/up, down projections and the LM head of SmolLM2-135M
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {s: torch.randn(*s, dtype=torch.bfloat16) * 0.02 for s in SHAPES}
    methods = {name: {s: cls(w) for s, w in weights.items()} for name, cls in SMALL_STEP_METHODS.items()}
    print(f"{'rows':>4} {'kernel':>6} " + " ".join(f"{o}x{i:>4}" for o, i in SHAPES) + "   sum(ms)")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {s: torch.randn(rows, s[1], dtype=torch.bfloat16) for s in SHAPES}
            results = {"bf16": [median_ms(lambda s=s, xs=xs: F.linear(xs[s], weights[s])) for s in SHAPES]}
            for name, per_shape in methods.items():
                results[name] = [
                    median_ms(lambda s=s, xs=xs, per_shape=per_shape: per_shape[s](xs[s])) for s in SHAPES
                ]
            for name, times in results.items():
                cells = " ".join(f"{t:9.3f}" for t in times)
                print(f"{rows:>4} {name:>6} {cells} {sum(times):9.3f}", flush=True)


if __name__ == "__main__":
    main()
