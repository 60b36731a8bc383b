"""Speculative decoding: decode speed with and without each proposer, in one run.

    .venv/bin/python benchmarks/spec_decode.py [--max-tokens 96] [--json out.json]

Default model (bf16), greedy. Two prompt sets: input-grounded (rewrite / summarise / edit a
given passage, code edits), where n-gram lookup should shine, and open-ended ones, where it
should cost next to nothing. Each proposer runs single-stream (one request at a time; the
median decode speed over the prompts) and 8-stream (8 requests together; generated tokens
over the decode window). Cells are interleaved across proposers and repeated `--rounds`
times (every other round in reverse order); the table shows medians over rounds. Speeds are
decode tokens/s after the first token; ratios are against no speculation in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fornax import LLM, SamplingParams

PASSAGE = (
    "The harbour town woke slowly. Fishing boats that had left before dawn were already turning back, "
    "gulls wheeling over their wakes, while the baker on the corner pulled the first trays of bread "
    "from an oven that had been burning since three in the morning. By eight the market square was full."
)
CODE = (
    "def total_price(items, tax):\n    result = 0\n    for item in items:\n        result = result + "
    "item.price * item.quantity\n    result = result * (1 + tax)\n    return result\n"
)
GROUNDED = [
    f"Rewrite this passage in the past perfect tense, keeping every detail:\n\n{PASSAGE}",
    f"Copy this passage exactly, but replace 'harbour' with 'port':\n\n{PASSAGE}",
    "Fix the spelling and return the full text:\n\nThe harbor town woke slowley. Fishing boats that had "
    "left before dawn were allready turning back, gulls wheeling over thier wakes.",
    f"Rename the variable `result` to `amount` in this Python function and return the code:\n\n{CODE}",
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    f"Summarize this passage in a few sentences, reusing its words:\n\n{PASSAGE}",
    f"Convert this function to use sum() and return it:\n\n{CODE}",
    f"Repeat this passage, then add one sentence of your own:\n\n{PASSAGE}",
]
OPEN = [
    "Write a short poem about the sea.",
    "What are three good habits for programmers?",
    "Explain why the sky is blue.",
    "Tell me a story about a brave mouse.",
    "How do I make a cup of tea?",
    "Give me a name for a pet turtle and explain it.",
    "What is the difference between weather and climate?",
    "Describe your ideal weekend.",
]
PROPOSERS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "self-int4": {"method": "self", "quantization": "int4", "num_speculative_tokens": 3},
}


def _decode_rate(out) -> float:
    n = len(out.outputs[0].token_ids) - 1
    return n / out.timings["decode_s"] if n > 0 and out.timings["decode_s"] > 0 else 0.0


def _single(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    outs = [llm.generate([p], params)[0] for p in prompts]
    return {"tok_s": statistics.median(_decode_rate(o) for o in outs)} | _spec_stats(outs)


def _batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    outs = llm.generate(prompts, params)
    first = min(o.timings["ttft_s"] for o in outs)  # all arrive together: a common clock
    last = max(o.timings["ttft_s"] + o.timings["decode_s"] for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return {"tok_s": tokens / (last - first)} | _spec_stats(outs)


def _spec_stats(outs) -> dict[str, float]:
    acc = [o.timings["spec_acceptance_rate"] for o in outs if "spec_acceptance_rate" in o.timings]
    mal = [o.timings["spec_mean_accepted_len"] for o in outs if "spec_mean_accepted_len" in o.timings]
    return {
        "acceptance": statistics.mean(acc) if acc else 0.0,
        "mean_accepted_len": statistics.mean(mal) if mal else 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=3, help="prompts per workload run one at a time")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; cells report medians")
    ap.add_argument("--row-cost", type=float, default=None, help="override the adaptive rule's row_cost")
    ap.add_argument(
        "--quantization", default="none", help="the target's weights: none (dense bf16), int8, int4, auto"
    )
    ap.add_argument("--large-step-quantization", default=None, help="w8a8: int8 x int8 past the small steps")
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="override the adaptive rule's batch limit"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.time()
    extra = {} if args.row_cost is None else {"row_cost": args.row_cost}
    if args.disable_by_batch_size is not None:
        extra["disable_by_batch_size"] = args.disable_by_batch_size
    quantization = None if args.quantization == "none" else args.quantization
    engines = {
        name: LLM(
            args.model,
            progress=False,
            kv_cache_memory="256MiB",
            quantization=quantization,
            large_step_quantization=args.large_step_quantization,
            speculative_config=None if spec is None else spec | extra,
        )
        for name, spec in PROPOSERS.items()
    }
    tok = engines["none"].get_tokenizer()

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )

    loads = {"grounded": [chat(t) for t in GROUNDED], "open": [chat(t) for t in OPEN]}
    warm = SamplingParams(max_tokens=16, temperature=0.0)
    for llm in engines.values():  # warm-up: every kernel shape the measured runs use, once
        llm.generate(loads["grounded"][:8], warm)
        llm.generate(loads["open"][:1], warm)
    print(f"loaded and warmed up in {time.time() - start:.0f} s", flush=True)
    # Interleaved: each (workload, mode) cell runs every proposer back to back, so slow drift
    # of this shared machine hits all of them alike.
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {} for name in engines}
    for round_no in range(args.rounds):
        for load, prompts in loads.items():
            for mode in ("1-stream", "8-stream"):
                # Every other round in reverse order: a fixed order put "none" first in every
                # cell, and one position read slower than another by up to ~9% on this machine.
                order = list(engines.items()) if round_no % 2 == 0 else list(engines.items())[::-1]
                for name, llm in order:
                    run = (
                        _single(llm, prompts[: args.single_prompts], params)
                        if mode == "1-stream"
                        else _batch(llm, prompts[:8], params)
                    )
                    runs[name].setdefault(f"{load}/{mode}", []).append(run)
        print(f"round {round_no + 1} done ({time.time() - start:.0f} s)", flush=True)
    results = {
        name: {
            cell: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for cell, rs in cells.items()
        }
        for name, cells in runs.items()
    }
    print("\n| workload | proposer | decode tok/s | vs none | acceptance | mean accepted len |")
    print("|---|---|---|---|---|---|")
    for cell in results["none"]:
        base = results["none"][cell]["tok_s"]
        for name in engines:
            r = results[name][cell]
            print(
                f"| {cell} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {r['acceptance']:.2f} "
                f"| {r['mean_accepted_len']:.2f} |"
            )
    print(f"\ntotal {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
