"""Where a decode step's time goes: engine steps under cProfile, grouped by part.

B requests (128-token prompts) are prefilled, then N pure decode steps run under cProfile;
the time is split by the functions that do each part:

  native step      the one-call small step: every layer in C (models/native_step.py)
  matmuls          torch's linear / int8 / int4 kernels and the native integer and bf16 ones, outside
                   the native step (the LM head included)
  attention        the native paged-attention call + writing new K/V into the pool
  fused ops        RMSNorm (+ residual add), rotary, SiLU * up
  sampling         the sampler on the step's logits
  scheduler        schedule() + update_from_output()
  detokenize       incremental detokenization, stop strings, outputs
  step metadata    flattening tokens, block tables, attention metadata
  Python glue      the rest: module calls, views, splits, bookkeeping

cProfile adds a few microseconds to every Python call, so Python-heavy parts read larger
than they are; the step time printed first is measured without it.

    .venv/bin/python benchmarks/decode_profile.py [--batch 1] [--quantization auto]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import time

from fornax import LLM, SamplingParams
from fornax.layers.native import Bf16Matmul, DecodeStepKernel, Int8Matmul, PagedAttentionKernel, QuantMatmul


def _call_of(cls: type) -> tuple[str, str, int]:
    """The profiler's key for cls.__call__: several classes in layers/native.py have one."""
    return ("layers/native.py", "__call__", inspect.getsourcelines(cls.__call__)[1])


# (part, [(file suffix, function name[, first line])], use cumulative time?)
PARTS = [
    ("native step", [_call_of(DecodeStepKernel)], False),
    (
        "matmuls",
        [
            ("~", "<built-in method torch._C._nn.linear>"),
            ("~", "<built-in method torch._weight_int4pack_mm_for_cpu>"),
            ("~", "<built-in method torch._weight_int8pack_mm>"),
            _call_of(QuantMatmul),
            _call_of(Bf16Matmul),
            _call_of(Int8Matmul),
        ],
        False,
    ),
    (
        "attention",
        [_call_of(PagedAttentionKernel), ("~", "<method 'index_copy_' of 'torch._C.TensorBase' objects>")],
        False,
    ),
    (
        "fused ops",
        [("layers/native.py", "rms_norm"), ("layers/native.py", "rotary_"), ("layers/native.py", "silu_mul")],
        True,
    ),
    ("sampling", [("sample/sampler.py", "__call__")], True),
    ("scheduler", [("engine/scheduler.py", "schedule"), ("engine/scheduler.py", "update_from_output")], True),
    ("detokenize", [("engine/core.py", "_detokenize"), ("engine/core.py", "_output")], True),
    (
        "step metadata",
        [("layers/attention.py", "build_attention_metadata"), ("runner/model_runner.py", "_flatten_tokens")],
        True,
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--quantization", default="auto", help="none, int8, int4 or auto")
    ap.add_argument("--large-step-quantization", default=None, help="w8a8: int8 x int8 for large steps")
    ap.add_argument("--small-step-max-rows", type=int, default=None)
    args = ap.parse_args()
    quant = None if args.quantization == "none" else args.quantization
    rows = {} if args.small_step_max_rows is None else {"small_step_max_rows": args.small_step_max_rows}
    llm = LLM(
        args.model,
        quantization=quant,
        large_step_quantization=args.large_step_quantization,
        progress=False,
        **rows,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * args.steps + 20, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [100 + (i * 37 + j) % 5000 for j in range(128)], params)
    for _ in range(8):  # prefill, then settle into decode
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3

    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    profiled = time.perf_counter() - start
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}

    print(
        f"batch {args.batch}, weights {args.quantization}: {step_ms:.2f} ms per decode step "
        f"({args.batch / step_ms * 1e3:.1f} tok/s); under cProfile {profiled / args.steps * 1e3:.2f} ms"
    )
    accounted = 0.0
    for part, funcs, cumulative in PARTS:
        total = 0.0
        for (path, line, name), (_cc, _nc, tottime, cumtime, _callers) in stats.items():
            if any(path.endswith(f[0]) and name == f[1] and f[2:] in ((), (line,)) for f in funcs):
                total += cumtime if cumulative else tottime
        accounted += total
        print(f"  {part:<14} {total / profiled:>6.1%}")
    print(f"  {'Python glue':<14} {1 - accounted / profiled:>6.1%}")


if __name__ == "__main__":
    main()
