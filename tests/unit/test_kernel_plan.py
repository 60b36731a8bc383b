"""The one place that chooses (layers/kernel_plan.py): each Linear's form for each step size,
from the kernels that run, the file's quantization and the flags. Pure: no model is loaded,
no kernel built; the CPUs are described by which native kernels load on them."""

from __future__ import annotations

import pytest
import torch

from fornax.layers.kernel_plan import (
    DENSE_BF16_MAX_ROWS,
    LM_HEAD_INT4_MAX_ROWS,
    ONE_FORM_ROWS,
    FormRequest,
    Kernels,
    LinearPlan,
    LinearShape,
    NoBatchInvariantForm,
    describe,
    plan_linear,
)

# Every native level (AVX2, AVX-512, NEON) loads these; AMX adds its tiles; no compiler: none.
# NATIVE is a CPU whose torch multiplies bf16 natively (AVX-512 BF16); AVX2's torch emulates it.
NATIVE = Kernels(integer=True, bf16=True, f32=True, int8=True)
AVX2 = Kernels(integer=True, bf16=True, f32=True, int8=True, torch_bf16=False)
AMX = Kernels(integer=True, bf16=True, f32=True, int8=True, amx=True)
TORCH = Kernels()

MAKE_RUN = FormRequest("auto", 1, "w8a8", 1)  # --quantization auto --large-step-quantization w8a8
Q4_LAYER = LinearShape(2048, torch.bfloat16, frozenset({"int4"}), file_int4_blocks=True)
Q6_LAYER = LinearShape(2048, torch.bfloat16, frozenset({"int8"}))  # Q6_K / Q8_0 in the file
FLOAT_LAYER = LinearShape(2048, torch.bfloat16)


def forms(plan: LinearPlan, rows=(1, 2, 12, 64, 65, 512)) -> list[str]:
    return [plan.form_for(r) for r in rows]


def test_make_runs_flags_on_a_q4_file_decode_the_files_blocks_and_multiply_int8_above():
    plan = plan_linear(Q4_LAYER, NATIVE, MAKE_RUN)
    assert plan.small == "int4" and plan.small_from_file and plan.small_max_rows == 1
    assert forms(plan) == ["int4"] + ["int8 x int8"] * 5
    assert not plan.keep_dense  # int4 for one row, int8 x int8 from two: nothing reads bf16
    # a 6-bit tensor is requantized to int8 blocks, which the int8 x int8 form supersedes
    plan = plan_linear(Q6_LAYER, NATIVE, MAKE_RUN)
    assert plan.small is None and forms(plan) == ["int8 x int8"] * 6 and not plan.keep_dense
    # a float tensor in the same file stays dense below, int8 x int8 still above
    assert forms(plan_linear(FLOAT_LAYER, NATIVE, MAKE_RUN)) == ["int8 x int8"] * 6


def test_without_native_kernels_the_same_flags_give_torchs_forms_and_keep_the_dense_weight():
    plan = plan_linear(Q4_LAYER, TORCH, MAKE_RUN)
    assert plan.small == "int4 (torch)" and plan.small_from_file and plan.large is None
    assert forms(plan) == ["int4 (torch)"] + ["bf16 (torch)"] * 5 and plan.keep_dense


def test_dense_bf16_models_stream_small_steps_through_the_native_kernel():
    plan = plan_linear(FLOAT_LAYER, NATIVE, FormRequest(None, 12))
    assert forms(plan) == ["bf16"] * 4 + ["bf16 (torch)"] * 2
    assert plan.small_max_rows == DENSE_BF16_MAX_ROWS and plan.keep_dense
    # past a quantized small form, the mid tier takes over up to its limit
    plan = plan_linear(FLOAT_LAYER, NATIVE, FormRequest("int4", 12))
    assert forms(plan) == ["int4"] * 3 + ["bf16", "bf16 (torch)", "bf16 (torch)"]
    assert (plan.mid, plan.mid_max_rows) == ("bf16", DENSE_BF16_MAX_ROWS)
    # and nowhere int8 x int8 runs: it beats the bf16 kernel at every row count
    plan = plan_linear(FLOAT_LAYER, NATIVE, FormRequest("int4", 12, "w8a8", 1))
    assert plan.mid is None and forms(plan) == ["int4"] * 3 + ["int8 x int8"] * 3


def test_where_torch_would_emulate_bf16_the_native_kernel_takes_every_row_count():
    """On AVX2 (and AVX-512 without BF16) torch's bf16 linear is emulated, ~3.3x slower than the
    native kernel at every size measured: no bf16 step falls through to it."""
    plan = plan_linear(FLOAT_LAYER, AVX2, FormRequest(None, 12))
    assert forms(plan) == ["bf16"] * 6 and plan.small_max_rows == ONE_FORM_ROWS
    plan = plan_linear(FLOAT_LAYER, AVX2, FormRequest("int4", 12))
    assert forms(plan) == ["int4"] * 3 + ["bf16"] * 3 and plan.mid_max_rows == ONE_FORM_ROWS
    # even with no small-step forms asked for (small_max_rows 0)
    assert forms(plan_linear(FLOAT_LAYER, AVX2, FormRequest())) == ["bf16"] * 6
    # int8 x int8 still takes the large steps where asked
    assert forms(plan_linear(FLOAT_LAYER, AVX2, FormRequest(None, 12, "w8a8", 1))) == ["int8 x int8"] * 6


@pytest.mark.parametrize("kernels", [NATIVE, AVX2], ids=["avx512", "avx2"])
def test_float32_layers_take_the_native_loop_for_every_row_count(kernels):
    f32 = LinearShape(2048, torch.float32)
    plan = plan_linear(f32, kernels, FormRequest(None, 12))
    assert forms(plan) == ["f32"] * 6 and plan.keep_dense and plan.small_max_rows == ONE_FORM_ROWS
    # past a quantized small form, every row count above it
    plan = plan_linear(f32, kernels, FormRequest("int4", 12))
    assert forms(plan) == ["int4"] * 3 + ["f32"] * 3 and plan.mid_max_rows == ONE_FORM_ROWS
    # none asked for (no small-step forms at all), or no native float32 kernel: torch's linear
    assert forms(plan_linear(f32, kernels, FormRequest())) == ["f32 (torch)"] * 6
    assert forms(plan_linear(f32, TORCH, FormRequest(None, 12))) == ["f32 (torch)"] * 6


def test_odd_widths_keep_torchs_linear():
    f32 = LinearShape(40, torch.float32)  # not a multiple of the float32 loop's 16 lanes
    assert forms(plan_linear(f32, NATIVE, FormRequest(None, 12))) == ["f32 (torch)"] * 6
    odd = LinearShape(40, torch.bfloat16)  # not a multiple of the 32-value blocks
    plan = plan_linear(odd, NATIVE, FormRequest("int4", 12, "w8a8", 1))
    assert forms(plan) == ["int4 (torch)"] * 3 + ["bf16 (torch)"] * 3


def test_a_weight_only_int8_form_under_int8_x_int8_from_the_first_row_is_dropped():
    plan = plan_linear(FLOAT_LAYER, NATIVE, FormRequest("int8", 12, "w8a8", 1))
    assert plan.small is None and plan.large_min_rows == 1  # one int8 copy of the weights, not two
    plan = plan_linear(FLOAT_LAYER, NATIVE, FormRequest("int8", 12, "w8a8", 16))
    assert forms(plan) == ["int8"] * 3 + ["int8 x int8"] * 3
    assert plan.keep_dense  # rows 13-15 fall through to the dense weight


def test_the_int4_lm_head_serves_one_and_two_rows_where_the_integer_kernels_run():
    head = LinearShape(576, torch.bfloat16, frozenset({"int8"}), is_lm_head=True)
    request = FormRequest("auto", 1, "w8a8", 1, lm_head_int4=True)
    plan = plan_linear(head, NATIVE, request)
    assert (plan.small, plan.small_max_rows, plan.small_from_file) == ("int4", LM_HEAD_INT4_MAX_ROWS, False)
    assert forms(plan, (1, 2, 3)) == ["int4", "int4", "int8 x int8"] and not plan.notes
    plan = plan_linear(head, TORCH, request)
    assert plan.small == "int8 (torch)" and plan.notes  # the warning the loader logs
    assert plan_linear(FLOAT_LAYER, NATIVE, request).small is None  # only the head


@pytest.mark.parametrize(
    "shape,kernels,request_,form",
    [
        (FLOAT_LAYER, AMX, FormRequest(None, 12), "bf16 (amx)"),
        (FLOAT_LAYER, NATIVE, FormRequest(None, 12), "bf16"),
        (FLOAT_LAYER, NATIVE, FormRequest(None, 0), "bf16"),
        (LinearShape(2048, torch.float32), NATIVE, FormRequest(None, 12), "f32"),
        (Q4_LAYER, NATIVE, FormRequest("auto", 12), "int4"),
        (Q4_LAYER, NATIVE, MAKE_RUN, "int8 x int8"),
        (FLOAT_LAYER, AMX, FormRequest("int8", 12), "int8"),
    ],
)
def test_deterministic_mode_keeps_one_batch_invariant_form_for_every_row_count(
    shape, kernels, request_, form
):
    plan = plan_linear(shape, kernels, FormRequest(**{**request_.__dict__, "deterministic": True}))
    assert forms(plan, (1, 7, 64, 100_000)) == [form] * 4 and plan.mid is None
    if plan.small is not None:
        assert plan.small_max_rows == ONE_FORM_ROWS


@pytest.mark.parametrize("shape", [FLOAT_LAYER, Q4_LAYER, LinearShape(40, torch.float32)])
def test_deterministic_mode_without_a_batch_invariant_form_is_an_error(shape):
    with pytest.raises(NoBatchInvariantForm, match="no batch-invariant form"):
        plan_linear(shape, TORCH, FormRequest("auto", 12, deterministic=True))


def test_a_self_draft_keeps_the_dense_weight_its_own_forms_come_from():
    plan = plan_linear(Q4_LAYER, NATIVE, FormRequest("auto", 1, "w8a8", 1, keep_dense=True))
    assert plan.keep_dense and plan.dense_name == "bf16 (torch)"
    assert plan_linear(Q4_LAYER, NATIVE, MAKE_RUN).dense_name == "none"


def test_the_summary_line_reads_the_plans():
    plans = [plan_linear(Q4_LAYER, NATIVE, MAKE_RUN)] * 3 + [plan_linear(Q6_LAYER, NATIVE, MAKE_RUN)]
    line = describe(plans, "bf16", level="avx2+fma")
    assert line == "kernels: avx2+fma; decode int4/int8 x int8, large steps int8 x int8, attention bf16"
    dense = [plan_linear(LinearShape(64, torch.float32), TORCH, FormRequest())]
    assert describe(dense, "torch", level="none (torch ops)").endswith(
        "decode f32 (torch), large steps f32 (torch), attention torch"
    )
