"""What int8 K/V pools (--kv-cache-dtype int8, layers/kv_pool.py) buy decode attention, in one
process: one decode step's paged attention over 30 layers' pools in the model's dtype (bf16)
and in int8 with scales, taking turns pass by pass. The setting is that of huge_pages.py:
SmolLM2-135M's head layout, each sequence's blocks scattered over a pool of 4,096 blocks,
16 MiB of other memory traffic between layers (as a step's weights would be), both pools on
huge pages. Each figure is the median of 15 passes, in ms per pass (30 layers).

    .venv/bin/python benchmarks/kv_cache_int8.py [--attention 1x512,1x2048,8x1024,32x256]

Whole decode steps at 128 and 2,000 tokens of context, with and without int8 K/V, come from
offline_throughput.py (forms with +kv8).
"""

from __future__ import annotations

import argparse

import torch
from huge_pages import LAYERS, attention_case  # benchmarks/ is on sys.path when run as a script

from fornax.layers.kv_pool import LayerKV
from fornax.layers.native import load_paged_attention


def bf16_and_int8_pools(shape: tuple[int, int, int]) -> dict[str, list[LayerKV]]:
    out = {}
    for name, kv_cache_dtype in (("bf16", "auto"), ("int8", "int8")):
        pools = []
        for _ in range(LAYERS):
            pool = LayerKV.allocate(*shape, torch.bfloat16, kv_cache_dtype)
            rows = torch.randn(shape).bfloat16()
            pool.write(torch.arange(shape[0]), rows, rows.roll(1, 0))
            pools.append(pool)
        out[name] = pools
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="1x512,1x2048,8x1024,32x256", help="batch x context cases")
    args = ap.parse_args()
    kernel = load_paged_attention()
    if kernel is None:
        raise SystemExit("the native kernels do not run here (no C compiler)")
    torch.manual_seed(0)
    for case in args.attention.split(","):
        batch, context = map(int, case.split("x"))
        attention_case(batch, context, kernel, bf16_and_int8_pools)


if __name__ == "__main__":
    main()
