"""The one-call small step (kernels/decode_step.c) computes what the op-by-op native path does.

It calls the same kernels in the same order, so the claim is bit-equality, not closeness:
the same greedy tokens and the same logprobs, to the last bit, on tiny random models of each
family it covers (plain Llama, Llama 3 RoPE scaling with tied embeddings, Mistral's sliding
window, Qwen2's QKV bias), in bf16 and fp32, with int4 and int8 weights, with dense bf16
weights (the native bf16 matmul) and with int8 x int8 steps (Int8Rotated), for batches of
decodes, short prompts it prefills itself, and speculative verification rows, with K/V
pools in the model's dtype and in int8 (both paths write int8 rows with the C writer, which
test_native_kernels.py holds to torch's quantization bit for bit). Qwen3's
per-head Q/K norms are not in the C step: such a model must run op by op.
"""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams
from fornax.layers.kernel_plan import DENSE_BF16_MAX_ROWS, ONE_FORM_ROWS, Kernels
from fornax.layers.linear import DenseBf16, Int8Rotated, Linear
from fornax.layers.native import load_decode_step
from fornax.models.native_step import UNBOUNDED_ROWS
from tests.model.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(load_decode_step() is None, reason="no native kernels (no C compiler)")

PROMPTS = [
    [5, 17, 99, 200, 31, 7],
    [3] * 3 + list(range(40, 80)),  # past Mistral's window of 24 once generated; prefilled op by op
    [250],
    [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8],  # repetitive: n-gram drafts get proposed and verified
    list(range(300, 330)),  # with the others, a first step of 91 rows: past the integer kernels' 64
]

# The dense bf16 tier's limit: DENSE_BF16_MAX_ROWS, or every row count where torch's bf16 linear
# would be emulated (layers/kernel_plan.py)
BF16_ROWS = DENSE_BF16_MAX_ROWS if Kernels.here("native").torch_bf16 else ONE_FORM_ROWS


@pytest.fixture(scope="module", params=["llama", "llama3", "mistral", "qwen2", "qwen3"])
def tiny_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"native-step-{request.param}")
    build_tiny_model(request.param, out)
    return request.param, str(out)


def _pair(path: str, **kwargs) -> tuple[LLM, LLM]:
    """Two engines on the same weights: one with the one-call step, one forced op by op."""
    fused = LLM(path, num_blocks=64, progress=False, **kwargs)
    op_by_op = LLM(path, num_blocks=64, progress=False, **kwargs)
    op_by_op.engine.runner.native_step = None
    return fused, op_by_op


@pytest.mark.parametrize(
    "dtype,quantization,small_rows,large,kv",
    [
        ("bfloat16", "int4", 24, None, "auto"),
        ("float32", "int8", 24, None, "auto"),
        ("bfloat16", "int8", 24, None, "auto"),
        ("bfloat16", None, 24, None, "auto"),
        (
            "bfloat16",
            "int4",
            2,
            None,
            "auto",
        ),  # batches of 3-4 rows: past the int4 tier, into the bf16 mid tier
        ("bfloat16", "int4", 2, "w8a8", "auto"),  # 3-4 rows: the int8 x int8 tier, in place of the mid one
        ("bfloat16", None, 0, "w8a8", "auto"),  # every step int8 x int8
        ("float32", "int8", 1 << 30, None, "auto"),  # every step int8, the 91-row prefill in chunks of 64
        ("bfloat16", "int4", 24, None, "int8"),  # int8 K/V: the step quantizes rows as torch does
        ("float32", "int8", 1 << 30, None, "int8"),
    ],
)
def test_same_tokens_and_logprobs(tiny_dir, dtype, quantization, small_rows, large, kv):
    arch, path = tiny_dir
    fused, op_by_op = _pair(
        path,
        dtype=dtype,
        quantization=quantization,
        small_step_max_rows=small_rows,
        large_step_quantization=large,
        kv_cache_dtype=kv,
    )
    if arch == "qwen3":
        assert fused.engine.runner.native_step is None
        return
    assert fused.engine.runner.native_step is not None
    linears = [m for m in fused.engine.runner.model.modules() if isinstance(m, Linear)]
    step = fused.engine.runner.native_step
    tiers = [rows for rows, _ in step.tiers]
    if large is not None:  # int8 x int8 past the small tier, if any; no bf16 mid tier
        assert all(isinstance(m.large, Int8Rotated) and m.mid is None for m in linears)
        assert tiers == ([small_rows] if small_rows else []) + [UNBOUNDED_ROWS]
    elif quantization is None:  # dense bf16: the native bf16 form, to its own row limit
        assert all(isinstance(m.small, DenseBf16) and m.small_max_rows == BF16_ROWS for m in linears)
        assert tiers == [BF16_ROWS]
    elif dtype == "bfloat16":  # quantized up to small_rows, then the bf16 tier
        assert all(isinstance(m.mid, DenseBf16) and m.mid_max_rows == BF16_ROWS for m in linears)
        assert tiers == [small_rows, BF16_ROWS]
    else:  # float32 weights: the float32 loop past the int8 tier, op by op (the C step has no such tier)
        assert all((m.mid is None) == (small_rows >= ONE_FORM_ROWS) for m in linears) and tiers == [
            small_rows
        ]
    calls = _count_calls(fused)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)
    a, b = fused.generate(PROMPTS, params), op_by_op.generate(PROMPTS, params)
    assert calls["n"] > 10  # the decode steps did go through it
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids, arch
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert (lx.logprob, lx.top_ids, lx.top_logprobs) == (ly.logprob, ly.top_ids, ly.top_logprobs), (
                arch
            )
    fused.engine.check_integrity()


def test_speculative_verification_rows(tiny_dir):
    """Verification runs several new tokens per sequence through the step's attention rows."""
    arch, path = tiny_dir
    if arch == "qwen3":
        pytest.skip("not covered by the C step")
    always = {"disable_by_batch_size": 0, "row_cost": 0.0, "draft_cost": 0.0}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, **always}
    fused, op_by_op = _pair(path, dtype="float32", quantization="int4", speculative_config=spec)
    calls = _count_calls(fused)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    a, b = fused.generate(PROMPTS, params), op_by_op.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert calls["multi"] > 0  # some step carried more than one new token per sequence
    fused.engine.check_integrity()


def _count_calls(llm: LLM) -> dict[str, int]:
    """Wrap the engine's step to count the calls that went through it (and those with drafts)."""
    step = llm.engine.runner.native_step
    counts = {"n": 0, "multi": 0}
    original = step.__call__

    class Counting:
        def covers(self, meta, num_tokens, lora=None):
            return step.covers(meta, num_tokens, lora)

        def __call__(self, input_ids, positions, meta, lora=None):
            counts["n"] += 1
            counts["multi"] += int(len(set(meta.kernel_rows.row_seq.tolist())) < len(input_ids))
            return original(input_ids, positions, meta, lora)

    llm.engine.runner.native_step = Counting()
    return counts


def test_engine_sets_its_thread_count(tmp_path):
    import torch

    build_tiny_model("llama", tmp_path)
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tmp_path), num_blocks=64, progress=False, quantization="int4", num_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        torch.set_num_threads(before)
