"""Decode-step time by batch size, a small-step form against torch's dense bf16, in one run.

Each batch of B requests (200-token prompts) is prefilled, then the same engine times
decode steps with the small-step form switched on for every step and then off (torch's
dense bf16 linear, oneDNN). The form is int4 by default (its crossover sets the default
`small_step_max_rows`); `--quantization none` measures the native bf16 kernel of dense
models instead (its crossover sets DENSE_BF16_MAX_ROWS in fornax/layers/kernel_plan.py).

    .venv/bin/python benchmarks/decode_step.py [--batches 1,8,16,32,64] [--steps 8] [--quantization none]
"""

from __future__ import annotations

import argparse
import time

from fornax import LLM, SamplingParams
from fornax.layers.linear import Linear


def set_rows(llm: LLM, rows: int) -> None:
    for module in llm.engine.runner.model.modules():
        if isinstance(module, Linear):
            module.small_max_rows = rows
            module.mid_max_rows = 0  # "off" is torch's dense linear, not the native bf16 tier
    step = llm.engine.runner.native_step  # the one-call small step takes what the linears take
    if step is not None:
        step.max_rows = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--quantization", default="int4", help="int4, int8, auto or none (the native bf16 form)"
    )
    args = parser.parse_args()
    quant = None if args.quantization == "none" else args.quantization
    form = args.quantization if quant else "native"
    llm = LLM(args.model, quantization=quant, small_step_max_rows=1 << 30, progress=False)
    engine = llm.engine
    print(f"{'batch':>5} {form + ' ms/step':>13} {'torch bf16 ms/step':>19} {'torch/' + form:>12}")
    for b in [int(x) for x in args.batches.split(",")]:
        params = SamplingParams(max_tokens=2 * args.steps + 8, temperature=0, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"b{b}-{i}", [100 + i] * 200, params)
        for _ in range(4):  # prefill and settle into pure decode steps
            engine.step()
        times = {}
        for name, rows in (("form", 1 << 30), ("bf16", 0)):
            set_rows(llm, rows)
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name] = (time.perf_counter() - start) / args.steps * 1e3
        print(
            f"{b:>5} {times['form']:>13.1f} {times['bf16']:>19.1f} {times['bf16'] / times['form']:>12.2f}",
            flush=True,
        )
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
