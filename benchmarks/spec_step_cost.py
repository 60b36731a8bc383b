"""What a verify step costs: whole engine decode steps timed by their number of rows.

Speculative decoding pays only while the extra verified rows cost less than the tokens they
bring. On a CPU they are real matmul work, so this measures the cost the draft budget
(fornax/engine/spec_decode/controller.py) has to assume, in one run:

  plain:   decode steps of B requests, no speculation (B = --batches), rows = B;
  verify:  the same engine kind with n-gram drafts always taken (row_cost 0, no batch
           limit), 1 request alone and 8 together, rows = requests + drafts.

Each engine step (schedule, forward, sampling, verification, bookkeeping) is timed whole;
steps that prefill are left out. The table gives the median milliseconds by rows.

    .venv/bin/python benchmarks/spec_step_cost.py [--quantization auto --large-step-quantization w8a8]
    .venv/bin/python benchmarks/spec_step_cost.py --quantization none --large-step-quantization none  # dense
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from spec_decode import GROUNDED, OPEN  # the spec benchmark's prompts, next to this script

from fornax import LLM, SamplingParams


def time_decode_steps(llm: LLM) -> dict[int, list[float]]:
    """Wrap the engine so every all-decode step's wall time is recorded by its row count."""
    core = llm.engine
    schedule, step = core.scheduler.schedule, core.step
    times: dict[int, list[float]] = defaultdict(list)
    current = {"rows": 0, "decode": False}

    def timed_schedule():
        out = schedule()
        current["rows"] = out.num_batched_tokens
        current["decode"] = all(
            item.request.num_computed_tokens >= len(item.request.prompt_token_ids) for item in out.scheduled
        )
        return out

    def timed_step():
        start = time.perf_counter()
        result = step()
        if current["decode"]:
            times[current["rows"]].append(time.perf_counter() - start)
        return result

    core.scheduler.schedule, core.step = timed_schedule, timed_step
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--large-step-quantization", default="w8a8", help="w8a8 or none")
    ap.add_argument("--batches", default="1,2,4,8,12,16,24,32,40")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    quant = None if args.quantization == "none" else args.quantization
    large = None if args.large_step_quantization == "none" else args.large_step_quantization
    common = {
        "progress": False,
        "kv_cache_memory": "512MiB",
        "quantization": quant,
        "large_step_quantization": large,
    }
    plain = LLM(args.model, **common)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "row_cost": 0.0, "disable_by_batch_size": 0}
    verify = LLM(args.model, speculative_config=spec, **common)
    tok = plain.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in GROUNDED + OPEN
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain.generate(prompts[:8], warm)
    verify.generate(prompts[:8], warm)
    plain_times, verify_times = time_decode_steps(plain), time_decode_steps(verify)
    lone, eight = defaultdict(list), defaultdict(list)
    batches = [int(b) for b in args.batches.split(",")]
    for _ in range(args.rounds):  # interleaved, so drift hits every column alike
        for b in batches:
            plain.generate((prompts * (b // len(prompts) + 1))[:b], params)
        for p in prompts[:4]:
            verify_times.clear()
            verify.generate([p], params)
            for rows, ts in verify_times.items():
                lone[rows] += ts
        for group in (prompts[:8], prompts[8:16]):
            verify_times.clear()
            verify.generate(group, params)
            for rows, ts in verify_times.items():
                eight[rows] += ts

    def cell(times: dict[int, list[float]], rows: int) -> str:
        ts = times.get(rows)
        return f"{1e3 * statistics.median(ts):.2f} ({len(ts)})" if ts else "-"

    print("\nmedian ms per decode step (steps measured)")
    print("| rows | plain | 1 request verifying | 8 requests verifying |")
    print("| --- | --- | --- | --- |")
    for rows in sorted(set(plain_times) | set(lone) | set(eight)):
        print(f"| {rows} | {cell(plain_times, rows)} | {cell(lone, rows)} | {cell(eight, rows)} |")


if __name__ == "__main__":
    main()
