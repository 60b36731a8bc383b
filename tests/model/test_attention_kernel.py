"""The native paged-attention kernel against the pure-torch path on the same paged cache.

Both paths see one step mixing lone decodes, short verification runs (several new tokens)
and a long prefill chunk over a cached prefix, with block tables scattered over the pool,
grouped-query heads and, in one case, a sliding window. The torch path is itself checked
against HF transformers by the model tests, so agreement here carries that over.
"""

from __future__ import annotations

import math

import pytest
import torch

from fornax.layers.attention import KERNEL_MAX_QUERIES, SeqSpan, build_attention_metadata, paged_attention
from fornax.layers.native import load_paged_attention

KERNEL = load_paged_attention()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel cannot be built here")

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64


def _step(seed: int, dtype: torch.dtype, spans_shape: list[tuple[int, int]]):
    """Random queries, new K/V and a cache holding every span's earlier tokens in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((s + n) / BLOCK) for s, n in spans_shape) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spans = []
    for start, num_new in spans_shape:
        need = math.ceil((start + num_new) / BLOCK)
        spans.append(SeqSpan(start=start, num_new=num_new, block_ids=[order.pop() for _ in range(need)]))
    total = sum(n for _, n in spans_shape)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_k, cache_v = rand(num_blocks * BLOCK, KV_HEADS, DIM), rand(num_blocks * BLOCK, KV_HEADS, DIM)
    return spans, rand(total, HEADS, DIM), rand(total, KV_HEADS, DIM), rand(total, KV_HEADS, DIM), cache_k, cache_v


def _attend(spans, q, k, v, cache_k, cache_v, kernel, window):
    meta = build_attention_metadata(spans, BLOCK, sliding_window=window, kernel=kernel)
    out = paged_attention(q, k, v, cache_k.clone(), cache_v.clone(), meta, scale=DIM**-0.5)
    return out.float(), meta


MIXED = [(37, 1), (0, 1), (130, 1), (64, 5), (200, KERNEL_MAX_QUERIES), (48, 40), (15, 1)]


@pytest.mark.parametrize(
    ("dtype", "window", "tol"),
    [(torch.float32, None, 2e-5), (torch.float32, 24, 2e-5), (torch.bfloat16, None, 2e-2), (torch.bfloat16, 24, 2e-2)],
)
def test_kernel_matches_torch_path_on_a_mixed_step(dtype, window, tol):
    spans, q, k, v, ck, cv = _step(0, dtype, MIXED)
    ref, ref_meta = _attend(spans, q, k, v, ck, cv, None, window)
    got, meta = _attend(spans, q, k, v, ck, cv, KERNEL, window)
    assert ref_meta.kernel_rows is None
    # The long chunk stays on SDPA; every other span goes to the kernel.
    assert meta.kernel_rows is not None and meta.kernel_rows.token_index is not None
    assert len(meta.groups) == 1
    assert (got - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_decode_step_uses_one_kernel_call(dtype):
    shape = [(n, 1) for n in (0, 1, 15, 16, 17, 255, 256, 400)]
    spans, q, k, v, ck, cv = _step(1, dtype, shape)
    ref, _ = _attend(spans, q, k, v, ck, cv, None, None)
    got, meta = _attend(spans, q, k, v, ck, cv, KERNEL, None)
    assert meta.kernel_rows.token_index is None and meta.groups == []
    assert (got - ref).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-2)


def test_kernel_reads_the_new_tokens_written_this_step():
    """A query must see its own K/V, which paged_attention writes into the cache just before."""
    spans, q, k, v, ck, cv = _step(2, torch.float32, [(0, 1)])
    got, _ = _attend(spans, q, k, v, ck, cv, KERNEL, None)
    # One key only: softmax weight 1, so the output is that token's V (per KV head group).
    expected = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    assert torch.allclose(got, expected, atol=1e-6)


def test_kernel_rejects_wrong_index_dtype():
    spans, q, k, v, ck, cv = _step(3, torch.float32, [(10, 1)])
    meta = build_attention_metadata(spans, BLOCK, kernel=KERNEL)
    kr = meta.kernel_rows
    with pytest.raises(ValueError, match="int32"):
        KERNEL(q, ck, cv, kr.block_tables.long(), kr.row_seq, kr.row_pos, BLOCK, 1.0, None)
