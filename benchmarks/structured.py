"""Structured outputs: what a JSON-schema constraint costs, side by side with free text.

In one run, on the default model with `make run`'s weight forms (--quantization auto
--large-step-quantization w8a8), for 1 and 16 concurrent streams:

  constrained    chat prompts asking for a product catalogue, `structured_outputs.json`
                 with a schema (arrays of objects, enums, bounded numbers), greedy;
  free           the same prompts without a constraint, each request's max_tokens set to
                 the length its constrained twin produced and EOS ignored, so both decode
                 exactly as many tokens per request.

Decode throughput is tokens after the first / (last token of the batch - first token of
the batch); the two alternate --repeats times and the ratio quoted is the median of the
per-pair ratios. Also reported: the mask worker's CPU time per constrained row (one row
= one token's mask), how much of it the step still waited for after its forward (the
rest overlapped), and cold compile times of the 20-schema corpus
(tests/structured/schemas.py).

    python benchmarks/structured.py
    python benchmarks/structured.py --repeats 5 --json structured.json

A measurement script, not a test: quote ratios; the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fornax import LLM, SamplingParams  # noqa: E402
from fornax.engine.structured.backend import GrammarBackend  # noqa: E402
from fornax.engine.structured.spec import StructuredOutputsParams  # noqa: E402
from tests.structured.schemas import SCHEMAS  # noqa: E402

CATALOG = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 30},
        "products": {
            "type": "array", "minItems": 6, "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "category": {"enum": ["food", "tools", "toys", "books", "clothes"]},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "price", "category", "in_stock"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["store", "products"],
    "additionalProperties": False,
}  # fmt: skip
TOPICS = ["a bakery", "a hardware shop", "a toy store", "a bookshop", "a clothing boutique", "a garden centre",
          "a market stall", "a corner shop"]  # fmt: skip


def _prompts(llm: LLM, streams: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": f"Write the product catalogue of {TOPICS[i % len(TOPICS)]} "
                                 f"(number {i}) as JSON."}], add_generation_prompt=True, tokenize=True)
        for i in range(streams)
    ]  # fmt: skip


def _decode_rate(outputs) -> tuple[float, list[int]]:
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    # All requests arrive together: the batch decodes from its first first-token to its last token.
    start = min(o.timings["ttft_s"] for o in outputs)
    end = max(o.timings["e2e_s"] for o in outputs)
    return sum(n - 1 for n in lengths) / (end - start), lengths


def run(llm: LLM, streams: int, repeats: int) -> dict:
    prompts = _prompts(llm, streams)
    constrained = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs={"json": CATALOG})
    # Warm-up: compiles the grammar, fills the caches, and gives each request's output length
    # (greedy: every constrained run repeats it) for its free twin.
    warm = llm.generate(prompts, constrained)
    lengths_seen = [len(o.outputs[0].token_ids) for o in warm]
    masks = llm.engine.runner.masks
    ratios, con_rates, free_rates, fill_us, wait_us = [], [], [], [], []
    truncated = 0
    for rep in range(repeats):
        order = ["constrained", "free"] if rep % 2 == 0 else ["free", "constrained"]
        rates: dict[str, float] = {}
        for kind in order:
            if kind == "constrained":
                steps, rows, fill, wait = masks.num_steps, masks.num_rows, masks.fill_seconds, masks.wait_seconds
                out = llm.generate(prompts, constrained)
                rates[kind], _ = _decode_rate(out)
                truncated = sum(o.outputs[0].finish_reason != "stop" for o in out)
                fill_us.append((masks.fill_seconds - fill) / max(masks.num_rows - rows, 1) * 1e6)
                wait_us.append((masks.wait_seconds - wait) / max(masks.num_steps - steps, 1) * 1e6)
            else:
                free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths_seen]
                rates[kind], _ = _decode_rate(llm.generate(prompts, free))
        con_rates.append(rates["constrained"])
        free_rates.append(rates["free"])
        ratios.append(rates["constrained"] / rates["free"])
    return {
        "streams": streams,
        "constrained_tok_s": statistics.median(con_rates),
        "free_tok_s": statistics.median(free_rates),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "mean_output_tokens": statistics.mean(lengths_seen),
        # Outputs that hit max_tokens before their JSON closed (the model rambling inside a
        # string): still decoded under the grammar, so they count alike in both rates.
        "truncated_outputs": truncated,
        "mask_fill_us_per_token": statistics.median(fill_us),
        "mask_wait_us_per_step": statistics.median(wait_us),
    }


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    backend = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size)
    backend._get_compiler()  # the one-off tokenizer table
    setup = time.perf_counter() - start
    times = []
    for name, schema, _ in SCHEMAS:
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append((time.perf_counter() - start) * 1e3)
    return {"tokenizer_setup_ms": setup * 1e3, "compile_ms_median": statistics.median(times),
            "compile_ms_max": max(times), "num_schemas": len(times)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(quantization="auto", large_step_quantization="w8a8", progress=False)
    results = {"compile": compile_times(llm), "decode": []}
    c = results["compile"]
    print(f"grammar compile ({c['num_schemas']} schemas, cold): median {c['compile_ms_median']:.1f} ms, "
          f"max {c['compile_ms_max']:.1f} ms; xgrammar import + tokenizer table {c['tokenizer_setup_ms']:.0f} ms once")  # fmt: skip
    print(f"{'streams':>7} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} {'tokens':>7} "
          f"{'mask us/tok':>11} {'wait us/step':>12} {'cut':>4}")  # fmt: skip
    for streams in (int(s) for s in args.streams.split(",")):
        r = run(llm, streams, args.repeats)
        results["decode"].append(r)
        print(f"{streams:>7} {r['free_tok_s']:>11.1f} {r['constrained_tok_s']:>11.1f} {r['ratio']:>6.3f} "
              f"{r['mean_output_tokens']:>7.0f} {r['mask_fill_us_per_token']:>11.1f} {r['mask_wait_us_per_step']:>12.1f} {r['truncated_outputs']:>4}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
