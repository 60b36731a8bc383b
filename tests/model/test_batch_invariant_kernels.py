"""The kernels deterministic mode rests on give a row the same bits whichever rows share its call
and at any thread count (docs/deterministic.md): the AMX and AVX-512 bf16 matmuls, the int8 x
int8 and 4/8-bit matmuls, and paged attention with fixed key parts. Each row is computed alone,
at several offsets inside batches of several sizes, and at one and two threads, and compared
bit for bit; the results are also checked against float32 references, so a kernel that
returned the same wrong bits everywhere would fail too."""

from __future__ import annotations

import pytest
import torch

from fornax.layers.attention import DETERMINISTIC_PART_KEYS
from fornax.layers.kv_pool import LayerKV
from fornax.layers.linear import AmxBf16, BlockInt4, DenseBf16, DenseF32, Int8Rotated
from fornax.layers.native import (
    load_amx_bf16_matmul,
    load_bf16_matmul,
    load_f32_matmul,
    load_int8_matmul,
    load_paged_attention,
    load_quant_matmul,
)

# A row count the kernels block by none of (4-row tiles, 6-row int8 blocks, 16-row AMX tiles).
ROWS = 37


def _thread_counts() -> list[int]:
    return [1, 2] if torch.get_num_threads() >= 2 else [1]


def _assert_row_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for the whole batch; every row's result equals that row computed alone, inside
    slices of other sizes and offsets, and at each thread count."""
    whole = fn(x)
    threads = torch.get_num_threads()
    try:
        for n in _thread_counts():
            torch.set_num_threads(n)
            assert torch.equal(fn(x), whole), f"{n} thread(s)"
            for r in (0, 1, 5, 16, ROWS - 1):
                assert torch.equal(fn(x[r : r + 1])[0], whole[r]), f"row {r} alone"
            for lo, hi in ((3, 20), (1, 18), (16, 33), (0, 7)):
                assert torch.equal(fn(x[lo:hi]), whole[lo:hi]), f"rows {lo}:{hi}"
    finally:
        torch.set_num_threads(threads)
    return whole


def _weights(out_f: int, in_f: int) -> torch.Tensor:
    torch.manual_seed(out_f + in_f)
    return (torch.randn(out_f, in_f) / in_f**0.5).bfloat16()


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (50, 192)])
def test_amx_matmul(shape: tuple[int, int]) -> None:
    kernel = load_amx_bf16_matmul()
    if kernel is None:
        pytest.skip("no AMX-BF16 on this CPU (or the OS does not grant it)")
    w = _weights(*shape)
    form = AmxBf16(w, kernel)
    assert torch.equal(form.dequantize(), w)  # packing loses nothing
    x = torch.randn(ROWS, shape[1]).bfloat16()
    y = _assert_row_invariant(form, x)
    ref = x.float() @ w.float().T
    torch.testing.assert_close(y.float(), ref, atol=0.02, rtol=0.01)


def test_dense_bf16_matmul() -> None:
    kernel = load_bf16_matmul()
    if kernel is None:
        pytest.skip("no AVX-512 BF16 on this CPU")
    # Rounding to bf16 hides most differences in the order of float32 sums: at 576 x 576 the
    # kernel before its reductions were made alike passed this check by luck; at this size 8 of
    # 37 rows differed. 4,098: a last tile of two weight rows.
    w = _weights(4098, 1536)
    x = torch.randn(ROWS, 1536).bfloat16()
    y = _assert_row_invariant(DenseBf16(w, kernel), x)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=0.02, rtol=0.01)


def test_f32_matmul() -> None:
    """Float32 output shows every difference in the order of sums (torch's own float32 linear
    gave all 37 rows other bits alone than in the batch, here, with MKL)."""
    kernel = load_f32_matmul()
    if kernel is None:
        pytest.skip("no AVX-512 on this CPU")
    torch.manual_seed(3)
    w = torch.randn(4098, 1536) / 40
    x = torch.randn(ROWS, 1536)
    y = _assert_row_invariant(DenseF32(w, kernel), x)
    torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)


def test_int8_rotated_and_int4_matmuls() -> None:
    int8, quant = load_int8_matmul(), load_quant_matmul()
    if int8 is None or quant is None:
        pytest.skip("no AVX-512 VNNI on this CPU")
    w = _weights(576, 576)
    x = torch.randn(ROWS, 576).bfloat16()
    ref = x.float() @ w.float().T
    for form in (Int8Rotated(w, int8), BlockInt4(w, quant)):
        y = _assert_row_invariant(form, x)
        assert (y.float() - ref).abs().mean() < 0.15 * ref.abs().mean()  # int4 of Gaussian weights: ~10%


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_with_fixed_parts(dtype: torch.dtype) -> None:
    """bf16 is the model's case; float32 output shows every difference in the order of the
    sums (bf16 rounding hides most: the adaptive split passes the bf16 check, not this one)."""
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("the native kernels do not build here")
    heads, kv_heads, dim, block = 9, 3, 64, 16
    lengths = [1, 40, 127, 128, 129, 300, 700, 2]  # around and across the part size
    tables, slot = [], 0
    for n in lengths:
        blocks = -(-n // block)
        tables.append(list(range(slot, slot + blocks))[::-1])  # scattered, reversed blocks
        slot += blocks
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    torch.manual_seed(1)
    cache = LayerKV(
        torch.randn(slot * block, kv_heads, dim).to(dtype),
        torch.randn(slot * block, kv_heads, dim).to(dtype),
    )
    # each sequence's last position as its query row, as a decode step has them
    row_seq = torch.arange(len(lengths), dtype=torch.int32)
    row_pos = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    scale = dim**-0.5

    def attend(rows: slice, part_keys: int) -> torch.Tensor:
        return kernel(
            q[rows].contiguous(),
            cache,
            block_tables,
            row_seq[rows].contiguous(),
            row_pos[rows].contiguous(),
            block,
            scale,
            None,
            part_keys,
        )

    whole = attend(slice(None), DETERMINISTIC_PART_KEYS)
    threads = torch.get_num_threads()
    try:
        for n in _thread_counts():
            torch.set_num_threads(n)
            for r in range(len(lengths)):
                assert torch.equal(attend(slice(r, r + 1), DETERMINISTIC_PART_KEYS)[0], whole[r]), (n, r)
            assert torch.equal(attend(slice(2, 6), DETERMINISTIC_PART_KEYS), whole[2:6])
    finally:
        torch.set_num_threads(threads)
    # the same attention as the adaptive split, up to the order of float32 additions
    torch.testing.assert_close(whole.float(), attend(slice(None), 0).float(), atol=0.02, rtol=0.02)
    # and as a float32 reference
    for r, n in enumerate(lengths):
        slots = torch.tensor([tables[r][p // block] * block + p % block for p in range(n)])
        k = cache.k[slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        v = cache.v[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", probs, v)
        torch.testing.assert_close(whole[r].float(), ref, atol=0.02, rtol=0.02)
