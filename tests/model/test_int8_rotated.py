"""int8 x int8 steps (Int8Rotated, kernels/int8_matmul.c) against their references.

- The activation rounding rotates each block of 32 by the Hadamard transform and rounds each
  row to int8 with scale max|v| / 127: checked against the same arithmetic in torch.
- The product is exactly the int8 product of the rounded activations and the stored weight,
  scaled once in float32 and rounded once to bf16: checked bit for bit against int64 sums in
  torch, at every register-block edge (1-13 rows) and panel edge (channels not a multiple of
  64), and for strided rows.
- The stored weight is within half an int8 step of W, and the whole is close to x W^T (a wrong
  rotation or scale would be off by ~100%).
- A tensor-parallel slice of each row, given the whole row's maxima, rounds as the whole row.
- Linear takes it by row count after the small tier and cuts the mid tier where it starts
  (the one-call step reads that limit); float32 Linears and widths the rotation cannot take
  stay dense.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fornax.layers.kernel_plan import FormRequest, LinearPlan
from fornax.layers.linear import DenseBf16, Int8Rotated, Linear, hadamard_blocks
from fornax.layers.native import load_int8_matmul

KERNEL = load_int8_matmul()
pytestmark = pytest.mark.skipif(
    KERNEL is None, reason="no AVX-512 VNNI or no C compiler: large steps stay bf16"
)


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = hadamard_blocks(x)  # [rows, k] float32
    m = v.abs().amax(dim=1)
    # full_like / m: one division, as the kernel's; torch's `127.0 / m` rounds twice
    inv = torch.where(m > 0, torch.full_like(m, 127.0) / m, torch.zeros_like(m))
    return torch.round(v * inv[:, None]).clamp(-127, 127).to(torch.int8), m / 127.0


def _assert_same_rounding(x: torch.Tensor) -> None:
    q, scale = KERNEL.quantize(x)
    q_ref, scale_ref = _reference_quantize(x.contiguous())
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # the transform's sums may be ordered differently: a value on a rounding boundary may move by one
    assert (q.int() - q_ref.int()).abs().max().item() <= 1
    assert (q != q_ref).float().mean().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_activation_rounding_matches_torch(rows, k):
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[:, 5] *= 40  # an outlier channel, as LLM activations have
    _assert_same_rounding(x)


def test_zero_rows_and_strided_rows():
    wide = torch.randn(4, 128).bfloat16()
    wide[2] = 0
    x = wide[:, :64]  # row stride 128: read in place
    q, scale = KERNEL.quantize(x)
    assert scale[2].item() == 0.0 and not q[2].any()
    _assert_same_rounding(x)


def _exact(form: Int8Rotated, x: torch.Tensor, given_max: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result from its parts: int64 sums of the rounded values, scaled, rounded once."""
    q, row_scale = KERNEL.quantize(x, given_max)
    sums = q.long() @ form.int8_weight().long().T  # [rows, out]
    col_scale = form.scale[: form.out_features]
    return (sums.float() * (row_scale[:, None] * col_scale[None, :])).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13])
@pytest.mark.parametrize("n, k", [(960, 576), (100, 64), (64, 1536)])
def test_product_is_exact_int8_arithmetic(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 100 + n + k)
    form = Int8Rotated((torch.randn(n, k, generator=gen) * 0.05).bfloat16(), KERNEL)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, 3] = 50.0
    assert torch.equal(form(x), _exact(form, x))


def test_strided_rows_zero_rows_and_closeness_to_bf16():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 576, generator=gen) * 0.05).bfloat16()
    form = Int8Rotated(w, KERNEL)
    wide = torch.randn(9, 2 * 576, generator=gen).bfloat16()
    wide[4] = 0
    x = wide[:, :576]  # a view with row stride 1152: read in place
    y = form(x)
    assert torch.equal(y, _exact(form, x.contiguous()))
    assert not y[4].any()
    # the stored weight, rotation undone, is within half an int8 step of W (+ float rounding)
    step = (form.scale[: form.out_features] * 32.0)[:, None]  # one int8 step of the rotated weight, per row
    assert ((form.dequantize() - w.float()).abs() <= step * 0.5 + 1e-6).all()
    ref = F.linear(x.float(), w.float())
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.03


def test_slices_of_a_row_round_as_the_whole_row():
    """A tensor-parallel rank's row-parallel projection holds a slice of each row (of W and of
    x). Given the whole row's maxima (a max across the ranks; here the other slice's, by hand),
    each slice's int8 weights, weight scales, activation rounding and scales are the whole
    row's, exactly; and the slices' partial products add up to the whole product."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 256, generator=gen) * 0.05).bfloat16()
    w[:, 200] *= 30  # the largest weight of each row in the second slice only
    x = torch.randn(7, 256, generator=gen).bfloat16()
    x[:, 3] = 40.0  # the largest activation in the first slice only
    cuts = (slice(0, 96), slice(96, 256))  # whole 32-value blocks
    whole = Int8Rotated(w, KERNEL)
    q_whole, scale_whole = KERNEL.quantize(x)
    row_max = [KERNEL.rotated_row_max(x[:, c]) for c in cuts]
    weight_max = [hadamard_blocks(w[:, c]).abs().amax(dim=1) for c in cuts]
    assert torch.equal(torch.maximum(*row_max), KERNEL.rotated_row_max(x))
    total, magnitude = torch.zeros(7, 96), torch.zeros(7, 96)
    for i, c in enumerate(cuts):
        other = 1 - i

        def across_ranks(t: torch.Tensor, other: int = other) -> None:
            t.copy_(torch.maximum(t, weight_max[other]))

        part = Int8Rotated(w[:, c], KERNEL, whole_row_max=across_ranks)
        assert torch.equal(part.int8_weight(), whole.int8_weight()[:, c])
        assert torch.equal(part.scale, whole.scale)
        given = torch.maximum(row_max[i], row_max[other])
        q, scale = KERNEL.quantize(x[:, c], given_max=given)
        assert torch.equal(q, q_whole[:, c]) and torch.equal(scale, scale_whole)
        y = KERNEL(x[:, c], part.packed, part.colsum, part.scale, part.out_features, given_max=given)
        assert torch.equal(y, _exact(part, x[:, c], given))
        total += y.float()
        magnitude += y.float().abs()
    # the same int8 products; one bf16 rounding of the whole sum against one of each part's
    y_whole = whole(x).float()
    assert ((total - y_whole).abs() <= (magnitude + y_whole.abs()) * 2**-8).all()


def test_rejects_what_it_cannot_read():
    form = Int8Rotated(torch.randn(64, 64).bfloat16(), KERNEL)
    with pytest.raises(ValueError):
        form(torch.randn(2, 64))  # float32 activations
    with pytest.raises(ValueError):
        form(torch.randn(2, 96).bfloat16())  # not the weight's width
    with pytest.raises(ValueError):
        KERNEL.quantize(torch.randn(2, 48).bfloat16())  # not a multiple of the 32-value blocks


def test_linear_tiers_by_row_count():
    lin = Linear(128, 64, True, torch.bfloat16)
    lin.weight.data.copy_((torch.randn(64, 128) * 0.1).bfloat16())
    lin.bias.data.copy_(torch.randn(64).bfloat16())
    # as the loader plans it: int4 up to 2 rows, int8 x int8 from 8, and no dense bf16 tier
    # where int8 x int8 runs (it beats it at every row count), so rows 3..7 fall to torch
    plan = lin.configure(FormRequest("int4", 2, "w8a8", 8))
    assert isinstance(lin.large, Int8Rotated) and lin.mid is None and plan.keep_dense
    assert [plan.form_for(r) for r in (1, 2, 3, 7, 8, 512)] == ["int4"] * 2 + ["bf16 (torch)"] * 2 + [
        "int8 x int8"
    ] * 2
    x = torch.randn(20, 128).bfloat16()
    assert torch.equal(lin(x[:2]), lin.small(x[:2]) + lin.bias)
    assert torch.equal(lin(x[:8]), lin.large(x[:8]) + lin.bias)
    assert torch.equal(lin(x), lin.large(x) + lin.bias)
    assert torch.equal(lin(x[:7]), F.linear(x[:7], lin.weight, lin.bias))
    # Linear's order with all three tiers (the one-call step reads them the same way)
    lin.build_forms(
        LinearPlan(
            small="int4", small_max_rows=2, mid="bf16", mid_max_rows=7, large="int8 x int8", large_min_rows=8
        )
    )
    assert isinstance(lin.mid, DenseBf16) and torch.equal(lin(x[:7]), lin.mid(x[:7]) + lin.bias)
    assert torch.equal(lin(x[:8]), lin.large(x[:8]) + lin.bias)
    plan = lin.configure(FormRequest("int4", 2, "w8a8", 1))  # from the first row past the small tier
    assert not plan.keep_dense and lin.weight is None  # every row count has a form: no dense copy
    assert torch.equal(lin(x[:3]), lin.large(x[:3]) + lin.bias)


def test_float32_and_odd_widths_stay_dense():
    f32 = Linear(64, 32, False, torch.float32)
    f32.configure(FormRequest(large_method="w8a8", large_min_rows=1))
    assert f32.large is None  # float32 models keep torch's linear (their HF parity is checked)
    odd = Linear(40, 8, False, torch.bfloat16)
    odd.configure(FormRequest(large_method="w8a8", large_min_rows=1))
    assert odd.large is None  # width not a multiple of the 32-value rotation blocks
