"""Structured outputs: what a JSON-schema constraint costs, side by side with free text.

In one run, on the default model with `make run`'s weight forms (--quantization auto
--large-step-quantization w8a8), for 1 and 16 concurrent streams:

  constrained    chat prompts asking for a product catalogue, `structured_outputs.json`
                 with a schema (arrays of objects, enums, bounded numbers), greedy;
                 twice: masks filled on a worker thread during the forward ("json+overlap",
                 the default) and after it on the engine thread ("json");
  free           the same prompts without a constraint, each request's max_tokens set to
                 the length its constrained twin produced and EOS ignored, so both decode
                 exactly as many tokens per request.

Decode throughput is tokens after the first / (last token of the batch - first token of
the batch); the three alternate --repeats times (order reversed every other round) and each
ratio quoted is the median of the per-round ratios to free. Also reported: CPU time per mask
(one constrained row = one token's mask), the time a step spent on masks after its forward
(filling them, or waiting for the worker), and cold compile times of the 20-schema corpus
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

from fornax import LLM, SamplingParams
from fornax.engine.structured.backend import GrammarBackend
from fornax.engine.structured.spec import StructuredOutputsParams
from tests.structured.schemas import SCHEMAS

CATALOG = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 30},
        "products": {
            "type": "array",
            "minItems": 6,
            "maxItems": 8,
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
}
TOPICS = [
    "a bakery",
    "a hardware shop",
    "a toy store",
    "a bookshop",
    "a clothing boutique",
    "a garden centre",
    "a market stall",
    "a corner shop",
]


def _prompts(llm: LLM, streams: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Write the product catalogue of {TOPICS[i % len(TOPICS)]} "
                    f"(number {i}) as JSON.",
                }
            ],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i in range(streams)
    ]


def _decode_rate(outputs) -> tuple[float, list[int]]:
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    # All requests arrive together: the batch decodes from its first first-token to its last token.
    start = min(o.timings["ttft_s"] for o in outputs)
    end = max(o.timings["e2e_s"] for o in outputs)
    return sum(n - 1 for n in lengths) / (end - start), lengths


def run(llm: LLM, streams: int, repeats: int) -> dict:
    prompts = _prompts(llm, streams)
    constrained = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs={"json": CATALOG})
    masks = llm.engine.runner.masks
    # Warm-up: compiles the grammar, fills the caches, and gives each request's output length
    # (greedy: every constrained run repeats it) for its free twin.
    warm = llm.generate(prompts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in warm]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    # "json+overlap": masks filled on a worker thread during the forward (the default);
    # "json": filled after the forward, on the engine thread.
    kinds = ["free", "json", "json+overlap"]
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    mask_cpu_us: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    mask_step_us: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    for rep in range(repeats):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            if kind == "free":
                rates[kind].append(_decode_rate(llm.generate(prompts, free))[0])
                continue
            masks.overlap = kind == "json+overlap"
            steps, rows, fill, wait = masks.num_steps, masks.num_rows, masks.fill_seconds, masks.wait_seconds
            out = llm.generate(prompts, constrained)
            rates[kind].append(_decode_rate(out)[0])
            mask_cpu_us[kind].append((masks.fill_seconds - fill) / max(masks.num_rows - rows, 1) * 1e6)
            mask_step_us[kind].append((masks.wait_seconds - wait) / max(masks.num_steps - steps, 1) * 1e6)
    masks.overlap = True  # back to the default
    result = {
        "streams": streams,
        "free_tok_s": statistics.median(rates["free"]),
        "mean_output_tokens": statistics.mean(lengths),
        # Outputs that hit max_tokens before their JSON closed (the model rambling inside
        # a string): still decoded under the grammar, and their free twins as long.
        "truncated_outputs": sum(o.outputs[0].finish_reason != "stop" for o in warm),
    }
    for kind in kinds[1:]:
        ratios = [c / f for c, f in zip(rates[kind], rates["free"])]
        result[kind] = {
            "tok_s": statistics.median(rates[kind]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "mask_cpu_us_per_token": statistics.median(mask_cpu_us[kind]),
            "mask_us_per_step_after_forward": statistics.median(mask_step_us[kind]),
        }
    return result


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    backend = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size)
    backend._get_compiler()  # the one-off tokenizer table
    setup = time.perf_counter() - start
    times = []
    for _name, schema, _ in SCHEMAS:
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append((time.perf_counter() - start) * 1e3)
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms_median": statistics.median(times),
        "compile_ms_max": max(times),
        "num_schemas": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(quantization="auto", large_step_quantization="w8a8", progress=False)
    results = {"compile": compile_times(llm), "decode": []}
    c = results["compile"]
    print(
        f"grammar compile ({c['num_schemas']} schemas, cold): median {c['compile_ms_median']:.1f} ms, "
        f"max {c['compile_ms_max']:.1f} ms; xgrammar import + tokenizer table "
        f"{c['tokenizer_setup_ms']:.0f} ms once"
    )
    print(
        f"{'streams':>7} {'free tok/s':>10} {'mode':>13} {'tok/s':>7} {'ratio':>6} {'tokens':>6} "
        f"{'mask us/tok':>11} {'after fwd us/step':>17} {'cut':>4}"
    )
    for streams in (int(s) for s in args.streams.split(",")):
        r = run(llm, streams, args.repeats)
        results["decode"].append(r)
        for kind in ("json", "json+overlap"):
            m = r[kind]
            print(
                f"{streams:>7} {r['free_tok_s']:>10.1f} {kind:>13} {m['tok_s']:>7.1f} {m['ratio']:>6.3f} "
                f"{r['mean_output_tokens']:>6.0f} {m['mask_cpu_us_per_token']:>11.1f} "
                f"{m['mask_us_per_step_after_forward']:>17.1f} {r['truncated_outputs']:>4}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
