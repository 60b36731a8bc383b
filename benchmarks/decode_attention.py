"""Decode attention (one query per sequence, masked to each context length): a masked SDPA
call against fornax's two-matmul path, side by side on the same tensors.

    .venv/bin/python benchmarks/decode_attention.py [--batch 12] [--context 410]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _timing import median_ms  # benchmarks/ is on sys.path when run as a script

from fornax.layers.attention import _decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--context", type=int, default=410)
    args = parser.parse_args()
    b, length, heads, kv_heads, dim = args.batch, args.context, 9, 3, 64  # SmolLM2-135M's head layout
    torch.manual_seed(0)
    q = torch.randn(b, heads, 1, dim, dtype=torch.bfloat16)
    k = torch.randn(b, kv_heads, length, dim, dtype=torch.bfloat16)
    v = torch.randn(b, kv_heads, length, dim, dtype=torch.bfloat16)
    lengths = torch.randint(length // 2, length + 1, (b,))
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    with torch.inference_mode():
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        ours = median_ms(lambda: _decode_attention(q, k, v, bias, dim**-0.5))
        diff = (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).float()
                - _decode_attention(q, k, v, bias, dim**-0.5).float()).abs().max().item()  # fmt: skip
    print(f"batch {b}, context {length}: masked SDPA {sdpa:.3f} ms, two matmuls {ours:.3f} ms, "
          f"ratio {sdpa / ours:.1f}x, max abs difference {diff:.4f} (bf16)")  # fmt: skip


if __name__ == "__main__":
    main()
