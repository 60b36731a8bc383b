"""The native bf16 small-step matmul (kernels/bf16_matmul.c) against exact arithmetic.

Each product of two bf16 values is exact in float32 and the kernel sums in float32, so its
result is the exact dot product (computed here in float64) to float32 summation error, then
rounded once to bf16: within one bf16 unit in the last place of the exact value. That is
checked for every tile edge (weight rows not a multiple of the 4-row tile, activation rows
not a multiple of the 4-row pass), strided activations, and the Linear that picks it by row
count.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fornax.layers.kernel_plan import DENSE_BF16_MAX_ROWS, ONE_FORM_ROWS, FormRequest, Kernels, plan_linear
from fornax.layers.linear import DenseBf16, DenseF32, Linear
from fornax.layers.native import load_bf16_matmul, load_f32_matmul

KERNEL = load_bf16_matmul()
pytestmark = pytest.mark.skipif(
    KERNEL is None, reason="no AVX-512 BF16 or no C compiler: torch's linear is used"
)


def _assert_rounded_once(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 8)  # bf16 keeps 8 significant bits
    assert y.dtype == torch.bfloat16
    assert bool(((y.double() - exact).abs() <= ulp + 1e-30).all()), (y.double() - exact).abs().max()


@pytest.mark.parametrize("n", [1, 4, 7, 130])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [32, 96])
def test_matches_exact_product_rounded_once(n, rows, k):
    gen = torch.Generator().manual_seed(n * 1000 + rows * 10 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    _assert_rounded_once(KERNEL(x, w), x, w)


def test_strided_rows_and_agreement_with_torch():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 2 * 576, generator=gen).bfloat16()
    x = wide[:, :576]  # a view with row stride 1152: read in place
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    y = KERNEL(x, w)
    _assert_rounded_once(y, x, w)
    # torch's bf16 linear sums in another order: the two may differ by one bf16 rounding
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-2)


def test_rejects_what_it_cannot_read():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError):
        KERNEL(x.float(), torch.randn(8, 64).bfloat16())
    with pytest.raises(ValueError):
        KERNEL(x, torch.randn(64, 8).bfloat16().T)  # not contiguous
    with pytest.raises(RuntimeError):
        KERNEL(torch.randn(2, 48).bfloat16(), torch.randn(8, 48).bfloat16())  # width not a multiple of 32


def test_linear_uses_it_for_small_steps_only_and_the_float32_loop_for_float32():
    lin = Linear(64, 40, bias=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    lin.weight.data.copy_(torch.randn(40, 64, generator=gen))
    lin.bias.data.copy_(torch.randn(40, generator=gen))
    plan = lin.configure(FormRequest(small_max_rows=4))  # up to DENSE_BF16_MAX_ROWS rows, or all
    native_bf16_torch = Kernels.here("native").torch_bf16  # else torch's bf16 is emulated
    assert lin.small_max_rows == (DENSE_BF16_MAX_ROWS if native_bf16_torch else ONE_FORM_ROWS) and (
        isinstance(lin.small, DenseBf16) and lin.small.weight.data_ptr() == lin.weight.data_ptr()
    )  # no copy
    small, large = torch.randn(DENSE_BF16_MAX_ROWS, 64).bfloat16(), torch.randn(65, 64).bfloat16()
    torch.testing.assert_close(lin(small), KERNEL(small, lin.weight.data) + lin.bias, rtol=0, atol=0)
    if native_bf16_torch:
        torch.testing.assert_close(lin(large), F.linear(large, lin.weight, lin.bias), rtol=0, atol=0)
    else:
        torch.testing.assert_close(lin(large), KERNEL(large, lin.weight.data) + lin.bias, rtol=0, atol=0)
    assert plan.form_for(65) == ("bf16 (torch)" if native_bf16_torch else "bf16")
    fp32 = Linear(64, 40, bias=False, dtype=torch.float32)
    fp32.configure(FormRequest(small_max_rows=4))
    # float32 layers: the float32 loop (kernels/f32_matmul.c) at every row count, where it builds
    assert fp32.small is None if load_f32_matmul() is None else isinstance(fp32.small, DenseF32)
    torch_backend = Linear(64, 40, bias=False, dtype=torch.bfloat16)
    torch_backend.configure(FormRequest(small_max_rows=4), backend="torch")
    assert torch_backend.small is None


def test_mid_tier_between_a_quantized_form_and_torch():
    from fornax.layers.linear import Int4Grouped

    lin = Linear(64, 48, bias=False, dtype=torch.bfloat16)  # torch's int4 packing wants N % 16 == 0
    lin.weight.data.copy_(torch.randn(48, 64, generator=torch.Generator().manual_seed(1)))
    lin.configure(FormRequest(small_method="int4", small_max_rows=2), backend="torch")
    assert isinstance(lin.small, Int4Grouped) and lin.mid is None  # no native kernel, no mid tier
    # with the native bf16 kernel (only it: torch's int4 below), the mid tier up to its limit
    plan = plan_linear(lin.shape(), Kernels(bf16=True), FormRequest("int4", 2))
    assert plan.mid == "bf16" and plan.mid_max_rows == DENSE_BF16_MAX_ROWS
    lin.build_forms(replace(plan, mid_max_rows=4))
    assert isinstance(lin.small, Int4Grouped) and isinstance(lin.mid, DenseBf16) and lin.mid_max_rows == 4
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(lin(x[:2]), lin.small(x[:2]), rtol=0, atol=0)  # rows <= 2: int4
    torch.testing.assert_close(lin(x[:4]), KERNEL(x[:4], lin.weight.data), rtol=0, atol=0)  # 3-4: bf16 kernel
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=0, atol=0)  # more: torch
