"""The native integer-dot-product matmuls (kernels/quant_matmul.c) against their definition.

The kernel rounds the activations to int8 in groups of 4 values (x * (127 / max |x|), round to
nearest even; scale max |x| / 127) and then computes exactly: integer dot products, float scales. So the test
builds that rounding in torch and expects the same result to float accumulation error, for
every tile edge (rows not a multiple of the 4-row tile, odd activation counts) and both
activation dtypes. Against the unrounded float product the error stays at the size of the
activation rounding (a few times bf16's rounding error), which is what quantization quality
is then measured on.
"""

from __future__ import annotations

import pytest
import torch

from fornax.layers.kernel_plan import FormRequest
from fornax.layers.linear import BlockInt4, BlockInt8, Int4Grouped, Linear
from fornax.layers.native import load_quant_matmul

KERNEL = load_quant_matmul()
pytestmark = pytest.mark.skipif(
    KERNEL is None, reason="no AVX-512 VNNI or no C compiler: torch's kernels are used"
)


def _rounded_activations(x: torch.Tensor) -> torch.Tensor:
    groups = x.float().view(x.shape[0], -1, 4)  # one int8 scale per 4 consecutive values
    amax = groups.abs().amax(-1, keepdim=True)
    # The kernels' own arithmetic: x times 127 / max (one correctly rounded division), not x
    # divided by the scale, nor torch's `127 / t` (a reciprocal, then a product: rounded
    # twice). The forms differ in the last bit, and where x * 127 / max lands next to a half
    # that flips one rounded value (1-2% of 131-row draws; the whole row then moves by ~1e-3).
    inv = torch.full_like(amax, 127.0) / amax
    return (torch.round(groups * inv) * (amax / 127)).view_as(x)


def _reference(form, x: torch.Tensor) -> torch.Tensor:
    """x W^T with the kernel's activation rounding; Q4's offsets meet the exact block sums."""
    xq = _rounded_activations(x)
    y = xq @ form.dequantize().T
    if isinstance(form, BlockInt4):
        n = form.out_features
        exact, rounded = x.float().view(x.shape[0], -1, 32).sum(-1), xq.view(x.shape[0], -1, 32).sum(-1)
        y += (exact - rounded) @ form.m[:n].float().T
    return y


@pytest.mark.parametrize("cls", [BlockInt4, BlockInt8])
@pytest.mark.parametrize("n,k", [(64, 64), (66, 128), (3, 576), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_matches_definition(cls, n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    form = cls(torch.randn(n, k, generator=gen) * 0.05, KERNEL)
    x = torch.randn(rows, k, generator=gen)
    y = form(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(form, x), atol=2e-5, rtol=1e-5)
    # Against the float product: only the activation rounding. On random Gaussian data that
    # is 3-7x what rounding the activations to bf16 costs (torch's int4/int8 kernels do that);
    # its effect on the model is bounded by the perplexity test (tests/model/test_quantization.py).
    w = form.dequantize()
    exact = x @ w.T
    ours = ((y - exact).norm() / exact.norm()).item()
    bf16 = ((x.bfloat16().float() @ w.T - exact).norm() / exact.norm()).item()
    assert ours < 8 * bf16, (ours, bf16)


@pytest.mark.parametrize("cls", [BlockInt4, BlockInt8])
def test_float16_activations_go_through_float32(cls):
    gen = torch.Generator().manual_seed(3)
    form = cls(torch.randn(8, 64, generator=gen) * 0.05, KERNEL)
    x = torch.randn(2, 64, generator=gen)
    y = form(x.half())
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), form(x.half().float()), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("cls", [BlockInt4, BlockInt8])
def test_bf16_activations_and_strided_rows(cls):
    gen = torch.Generator().manual_seed(1)
    form = cls(torch.randn(100, 192, generator=gen) * 0.05, KERNEL)
    wide = torch.randn(4, 300, generator=gen).bfloat16()
    x = wide[:, 50:242]  # rows with a stride, as a view into a fused projection's output
    y = form(x)
    assert y.dtype == torch.bfloat16
    ref = _reference(form, x.float())
    torch.testing.assert_close(y.float(), ref, atol=ref.abs().max().item() * 8e-3, rtol=8e-3)


def test_weights_round_trip():
    """BlockInt4 from a GGUF file's blocks keeps their values (float16 scales, as the file has)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (16, 128), generator=gen)
    scale = (torch.rand(16, 4, generator=gen) * 0.01).half().float()
    zero = (torch.randn(16, 4, generator=gen) * 0.01).half().float() + 8 * scale  # Q4_1: m + 8 d
    form = BlockInt4.from_blocks(q, scale, zero, KERNEL)
    torch_form = Int4Grouped.from_blocks(q, scale, zero, 32)
    expected = ((q.float().view(16, 4, 32) - 8) * scale[..., None] + zero[..., None]).view(16, 128)
    torch.testing.assert_close(form.dequantize(), expected, atol=1e-6, rtol=1e-3)
    # torch's int4 form rounds its scales to bf16; ours stays closer to the file.
    assert (form.dequantize() - expected).abs().max() <= (torch_form.dequantize() - expected).abs().max()
    w = torch.randn(6, 64, generator=gen)
    q8 = BlockInt8(w, KERNEL)
    assert (q8.dequantize() - w).abs().max() <= w.abs().max() / 127


def test_linear_picks_native_form_and_long_inputs_run_in_chunks():
    lin = Linear(128, 48, bias=False, dtype=torch.float32)
    torch.nn.init.normal_(lin.weight, std=0.05)
    lin.configure(FormRequest(small_method="int4", small_max_rows=1000))
    assert isinstance(lin.small, BlockInt4)
    x = torch.randn(KERNEL.MAX_ROWS * 2 + 3, 128)  # more rows than one kernel call takes
    torch.testing.assert_close(lin(x), _reference(lin.small, x), atol=2e-5, rtol=1e-5)
    torch_lin = Linear(128, 48, bias=False, dtype=torch.bfloat16)
    torch_lin.configure(FormRequest(small_method="int4", small_max_rows=24), backend="torch")
    assert isinstance(torch_lin.small, Int4Grouped)
