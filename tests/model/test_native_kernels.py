"""The native kernels against the pure-torch paths they replace.

Paged attention, on the same paged cache:

Both paths see one step mixing lone decodes, short verification runs (several new tokens)
and a long prefill chunk over a cached prefix, with block tables scattered over the pool,
grouped-query heads and, in one case, a sliding window. The torch path is itself checked
against HF transformers by the model tests, so agreement here carries that over. With int8
pools (--kv-cache-dtype int8) both paths read the same quantized rows, and the kernel's
result is also held to the exact attention over the unquantized cache.

Fused ops (RMSNorm with the residual add, rotary in place, SiLU * up): against the torch
expressions of layers/ops.py (TorchOps), on strided row views like the fused projections
produce; and NativeOps hands what its kernels do not cover back to TorchOps.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fornax.layers.attention import (
    KERNEL_MAX_CONTEXT,
    KERNEL_MAX_QUERIES,
    SeqSpan,
    build_attention_metadata,
    paged_attention,
)
from fornax.layers.kv_pool import LayerKV, dequantize_rows, quantize_rows
from fornax.layers.native import load_fused_ops, load_paged_attention
from fornax.layers.norm import RMSNorm
from fornax.layers.ops import NativeOps, TorchOps
from fornax.layers.rotary import RotaryEmbedding, apply_rotary

KERNEL = load_paged_attention()
FUSED = load_fused_ops()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel cannot be built here")

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64


def _step(seed: int, dtype: torch.dtype, spans_shape: list[tuple[int, int]], dim: int = DIM):
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

    cache_k, cache_v = rand(num_blocks * BLOCK, KV_HEADS, dim), rand(num_blocks * BLOCK, KV_HEADS, dim)
    return (
        spans,
        rand(total, HEADS, dim),
        rand(total, KV_HEADS, dim),
        rand(total, KV_HEADS, dim),
        cache_k,
        cache_v,
    )


def _pool(cache_k, cache_v, kv_cache_dtype):
    if kv_cache_dtype == "auto":
        return LayerKV(cache_k.clone(), cache_v.clone())
    pool = LayerKV.allocate(*cache_k.shape, cache_k.dtype, kv_cache_dtype)
    pool.write(torch.arange(cache_k.shape[0]), cache_k, cache_v)
    return pool


def _attend(spans, q, k, v, cache_k, cache_v, kernel, window, kv_cache_dtype="auto"):
    meta = build_attention_metadata(spans, BLOCK, sliding_window=window, kernel=kernel)
    out = paged_attention(q, k, v, _pool(cache_k, cache_v, kv_cache_dtype), meta, scale=q.shape[-1] ** -0.5)
    return out.float(), meta


# A long chunk over a long context (SDPA), one over a short context and a fresh short prompt
# (both kernel), among decodes and verification runs.
MIXED = [
    (37, 1),
    (0, 1),
    (130, 1),
    (64, 5),
    (200, KERNEL_MAX_QUERIES),
    (KERNEL_MAX_CONTEXT, 40),
    (48, 40),
    (0, 30),
    (15, 1),
]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize(
    ("dtype", "window", "tol"),
    [
        (torch.float32, None, 2e-5),
        (torch.float32, 24, 2e-5),
        (torch.bfloat16, None, 2e-2),
        (torch.bfloat16, 24, 2e-2),
    ],
)
def test_kernel_matches_torch_path_on_a_mixed_step(dtype, window, tol, kv_cache_dtype):
    spans, q, k, v, ck, cv = _step(0, dtype, MIXED)
    ref, ref_meta = _attend(spans, q, k, v, ck, cv, None, window, kv_cache_dtype)
    got, meta = _attend(spans, q, k, v, ck, cv, KERNEL, window, kv_cache_dtype)
    assert ref_meta.kernel_rows is None
    # The chunk over a long context stays on SDPA; every other span goes to the kernel.
    assert meta.kernel_rows is not None and meta.kernel_rows.token_index is not None
    assert len(meta.groups) == 1
    assert (got - ref).abs().max().item() < tol


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_decode_step_uses_one_kernel_call(dtype, kv_cache_dtype):
    shape = [(n, 1) for n in (0, 1, 15, 16, 17, 255, 256, 400)]
    spans, q, k, v, ck, cv = _step(1, dtype, shape)
    ref, _ = _attend(spans, q, k, v, ck, cv, None, None, kv_cache_dtype)
    got, meta = _attend(spans, q, k, v, ck, cv, KERNEL, None, kv_cache_dtype)
    assert meta.kernel_rows.token_index is None and meta.groups == []
    assert (got - ref).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dim", [64, 128, 16])  # 16: no vector score batches; converted per key
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_stays_close_to_exact_attention(dtype, dim):
    """The int8 pools' error, end to end: the kernel on int8 rows against float32 attention over
    the unquantized cache, at contexts up to 2,000 keys (the 16-key score batches' edges at 15,
    16, 17 and a ragged tail). Measured: ~0.7% relative error (float32 queries); the same
    cache shifted by one slot is off by 25%, so a misplaced row or a scale applied twice fails."""
    shape = [(n, 1) for n in (0, 14, 15, 16, 31, 300, 1999)]
    spans, q, k, v, ck, cv = _step(4, dtype, shape, dim)
    exact, _ = _attend(spans, q.float(), k.float(), v.float(), ck.float(), cv.float(), None, None)
    got, _ = _attend(spans, q, k, v, ck, cv, KERNEL, None, "int8")
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_written_by_the_kernel_equal_torchs_bit_for_bit(dtype):
    """The C writer (used by every native step and by paged_attention when the kernel is
    loaded) against LayerKV.write's torch quantization, on strided row views as the fused QKV
    projection hands them over, with an all-zero row, ties at half a step, and large values."""
    gen = torch.Generator().manual_seed(6)
    qkv = (torch.randn(40, (HEADS + 2 * KV_HEADS) * DIM, generator=gen) * 4).to(dtype)
    qkv[3] = 0
    # amax 127: scale exactly 1, so x.5 values are exact ties (round half to even on both sides)
    qkv[5, HEADS * DIM : (HEADS + 1) * DIM] = torch.tensor([127.0] + [i + 0.5 for i in range(-31, 32)])
    qkv[7] *= 1e4
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(40, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(40, KV_HEADS, DIM)
    slots = torch.randperm(64, generator=gen)[:40]
    by_torch = LayerKV.allocate(64, KV_HEADS, DIM, dtype, "int8")
    by_kernel = LayerKV.allocate(64, KV_HEADS, DIM, dtype, "int8")
    by_torch.write(slots, k, v)
    assert KERNEL.write_int8(by_kernel, slots, k, v)
    for a, b in zip(by_torch.tensors(), by_kernel.tensors()):
        assert torch.equal(a[slots], b[slots])
    assert not KERNEL.write_int8(by_kernel, slots.int(), k, v)  # what it does not take, it refuses


def test_a_fresh_prompt_on_sdpa_attends_to_its_int8_rows():
    """A lone fresh prompt past the kernel's context goes to plain causal SDPA over its own new
    K/V; with int8 pools it must see them as the cache holds them, as a batched prompt (read
    from the cache) does, or its result would depend on what it was batched with."""
    n = KERNEL_MAX_CONTEXT + 32
    spans, q, k, v, ck, cv = _step(8, torch.float32, [(0, n)])
    got, meta = _attend(spans, q, k, v, ck, cv, KERNEL, None, "int8")
    assert meta.kernel_rows is None and meta.groups[0].kv_slots is None  # the fresh SDPA path
    kq, vq = (dequantize_rows(*quantize_rows(x), torch.float32) for x in (k, v))

    def causal(kk, vv):
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            kk.transpose(0, 1)[None],
            vv.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )[0].transpose(0, 1)

    assert (got - causal(kq, vq)).abs().max().item() < 1e-5
    assert (got - causal(k, v)).abs().max().item() > 1e-3  # so the int8 rows were what it read


def test_quantize_rows_rounds_each_head_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(5)
    x = (
        torch.randn(7, KV_HEADS, DIM, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    )  # per-head ranges
    x[3, 1] = 0  # an all-zero row stays exactly zero (no division by a zero scale)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (7, KV_HEADS)
    assert torch.equal(q[3, 1], torch.zeros(DIM, dtype=torch.int8)) and scale[3, 1] == 0
    nonzero = scale > 0
    assert (q.abs().amax(-1)[nonzero] == 127).all()  # each row spans the full range
    err = (q.float() * scale[..., None] - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-6 * x.abs()).all()  # at most half a step per value


def test_kernel_reads_the_new_tokens_written_this_step():
    """A query must see its own K/V, which paged_attention writes into the cache just before."""
    spans, q, k, v, ck, cv = _step(2, torch.float32, [(0, 1)])
    got, _ = _attend(spans, q, k, v, ck, cv, KERNEL, None)
    # One key only: softmax weight 1, so the output is that token's V (per KV head group).
    expected = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    assert torch.allclose(got, expected, atol=1e-6)


def test_kernel_rejects_wrong_index_dtype():
    spans, q, _k, _v, ck, cv = _step(3, torch.float32, [(10, 1)])
    meta = build_attention_metadata(spans, BLOCK, kernel=KERNEL)
    kr = meta.kernel_rows
    with pytest.raises(ValueError, match="int32"):
        KERNEL(q, LayerKV(ck, cv), kr.block_tables.long(), kr.row_seq, kr.row_pos, BLOCK, 1.0, None)


# -- fused elementwise ops --

# bf16: the kernels round where torch rounds, so results agree to the last bit except where
# float32 sums are reassociated (the norm's mean): at most one bf16 ulp, rarely.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _strided_rows(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, dim] view with a row stride wider than dim, as a slice of a fused projection."""
    wide = torch.randn(rows, dim + 40, generator=torch.Generator().manual_seed(seed)) * 3
    return wide.to(dtype)[:, 8 : 8 + dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])  # one thread / the parallel loop
def test_rms_norm_with_and_without_residual(dtype, rows):
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.copy_(torch.rand(576) + 0.5)
    x, residual = _strided_rows(rows, 576, dtype, 0), _strided_rows(rows, 576, dtype, 1)
    ref_out, ref_sum = norm(x), None
    ref_add_out, ref_sum = norm.add_forward(x, residual)
    norm.ops = NativeOps(FUSED)
    out = norm(x)
    add_out, summed = norm.add_forward(x, residual)
    assert torch.equal(summed, ref_sum)  # the add rounds exactly like torch's
    assert (out.float() - ref_out.float()).abs().max().item() <= TOL[
        dtype
    ] * ref_out.float().abs().max().item()
    assert (add_out.float() - ref_add_out.float()).abs().max().item() <= TOL[
        dtype
    ] * ref_add_out.float().abs().max().item()
    assert norm.add_forward(x, None)[1] is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_gemma_norm_with_a_float32_weight(dtype, rows):
    """Gemma's norm: scaled by a float32 (1 + w) before the one rounding, rows or per-head [T, H, D]."""
    weight = torch.rand(640, generator=torch.Generator().manual_seed(3)) + 0.5
    x = _strided_rows(rows, 640, dtype, 2)
    ref = TorchOps().rms_norm_f32_weight(x, weight, 1e-6)
    out = NativeOps(FUSED).rms_norm_f32_weight(x, weight, 1e-6)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype] * ref.float().abs().max().item()
    heads = torch.randn(rows, 4, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    w256 = weight[:256].contiguous()
    ref_h, out_h = (
        TorchOps().rms_norm_f32_weight(heads, w256, 1e-6),
        NativeOps(FUSED).rms_norm_f32_weight(heads, w256, 1e-6),
    )
    assert out_h.shape == heads.shape
    assert (out_h.float() - ref_h.float()).abs().max().item() <= TOL[dtype] * ref_h.float().abs().max().item()
    if dtype == torch.bfloat16:  # rounds where torch rounds: all but a rare last-bit tie of the mean's order
        assert (out_h != ref_h).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_rotary_in_place_matches_apply_rotary(dtype, rows):
    heads, kv_heads, dim = HEADS, KV_HEADS, DIM
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(5)).to(
        dtype
    )
    rope = RotaryEmbedding(dim, 4096, 10000.0, None)
    cos, sin = rope.cos_sin(
        torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(6)), dtype
    )
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    ref_q = apply_rotary(q.reshape(rows, heads, dim), cos[:, None], sin[:, None])
    ref_k = apply_rotary(k.reshape(rows, kv_heads, dim), cos[:, None], sin[:, None])
    v_before = v.clone()
    FUSED.rotary_(qkv, heads + kv_heads, cos, sin)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 0.0  # bf16: every rounding step reproduced
    assert (q.reshape(rows, heads, dim).float() - ref_q.float()).abs().max().item() <= tol
    assert (k.reshape(rows, kv_heads, dim).float() - ref_k.float()).abs().max().item() <= tol
    assert torch.equal(v, v_before)  # V heads are left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul_matches_torch(dtype, rows):
    gate_up = _strided_rows(rows, 2 * 1536, dtype, 7)
    gate, up = gate_up.split(1536, dim=-1)
    ref = F.silu(gate) * up
    out = FUSED.silu_mul(gate_up)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype] * ref.float().abs().max().item()


def test_fused_ops_reject_bad_layouts():
    with pytest.raises(ValueError, match="contiguous rows"):
        FUSED.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        FUSED.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="2 \\* inter"):
        FUSED.silu_mul(torch.randn(4, 7))


def test_native_ops_agree_with_torch_ops_and_fall_back_where_not_covered():
    native, ref = NativeOps(FUSED), TorchOps()
    g = torch.Generator().manual_seed(9)
    w = (torch.rand(DIM, generator=g) + 0.5).bfloat16()
    per_head = torch.randn(4, HEADS, DIM, generator=g).bfloat16()  # Qwen3's Q/K norms: not rows
    assert torch.equal(native.rms_norm(per_head, w, 1e-5), ref.rms_norm(per_head, w, 1e-5))
    half = torch.randn(3, DIM, generator=g).half()  # no fp16 kernel
    assert torch.equal(native.rms_norm(half, w.half(), 1e-5), ref.rms_norm(half, w.half(), 1e-5))
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * DIM, generator=g).bfloat16()
    cos, sin = RotaryEmbedding(DIM, 64, 10000.0, None).cos_sin(torch.arange(5) * 7, torch.bfloat16)
    expected = ref.rotary_(qkv.clone(), HEADS + KV_HEADS, cos, sin)
    got = native.rotary_(qkv, HEADS + KV_HEADS, cos, sin)
    assert got.shape == (5, HEADS + KV_HEADS, DIM) and torch.equal(got, expected)
    gate_up = torch.randn(2, 2 * 96, generator=g).bfloat16()
    assert (native.silu_mul(gate_up).float() - ref.silu_mul(gate_up).float()).abs().max().item() < 2e-2
