"""Decode attention over the paged cache, one layer: the torch-ops path against the native kernel.

Both run fornax's own `paged_attention` on the same step (B sequences, one new token each,
context lengths spread over [L/2, L], blocks scattered over the pool, SmolLM2-135M's head
layout) and differ only in the backend:

  torch    gather each sequence's K/V into a padded copy, then two batched matmuls
  native   the compiled kernel reads the cache in place (layers/kernels/paged_attention.c)

    .venv/bin/python benchmarks/decode_attention.py [--batches 1,8,32] [--contexts 128,512,2048]
"""

from __future__ import annotations

import argparse
import random

import torch
from _timing import median_ms  # benchmarks/ is on sys.path when run as a script

from fornax.layers.attention import SeqSpan, build_attention_metadata, paged_attention
from fornax.layers.kv_pool import LayerKV
from fornax.layers.native import load_paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def one_case(batch: int, context: int, dtype: torch.dtype, kernel) -> tuple[float, float, float]:
    rng = random.Random(batch * 100003 + context)
    lengths = [rng.randint(max(1, context // 2), context) for _ in range(batch)]
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    spans = [SeqSpan(n - 1, 1, [free.pop() for _ in range(-(-n // BLOCK))]) for n in lengths]
    gen = torch.Generator().manual_seed(0)
    cache = LayerKV(*(torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in "kv"))
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(batch, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(batch, KV_HEADS, DIM, generator=gen).to(dtype)
    scale = DIM**-0.5
    # Metadata is built once per step and shared by all layers, so it is outside the timing.
    metas = {
        name: build_attention_metadata(spans, BLOCK, kernel=kn)
        for name, kn in (("torch", None), ("native", kernel))
    }
    with torch.inference_mode():
        outs = {name: paged_attention(q, k, v, cache, m, scale).float() for name, m in metas.items()}
        times = {
            name: median_ms(lambda m=m: paged_attention(q, k, v, cache, m, scale))
            for name, m in metas.items()
        }
    return times["torch"], times["native"], (outs["torch"] - outs["native"]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    kernel = load_paged_attention()
    if kernel is None:
        raise SystemExit("the native kernel could not be built here (no C compiler?)")
    dtype = getattr(torch, args.dtype)
    print(
        f"one layer of decode attention, {args.dtype}, {torch.get_num_threads()} threads (median ms per call)"
    )
    print(
        f"{'batch':>5} {'context':>8} {'torch ms':>9} {'native ms':>10} {'torch/native':>13} {'max abs diff':>13}"
    )
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            t, n, diff = one_case(b, ctx, dtype, kernel)
            print(f"{b:>5} {ctx:>8} {t:>9.3f} {n:>10.3f} {t / n:>13.2f} {diff:>13.5f}", flush=True)


if __name__ == "__main__":
    main()
