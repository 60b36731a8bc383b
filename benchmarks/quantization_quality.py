"""Quality of the weight forms, in one run: perplexity on a real English text, and how often
greedy continuations agree.

- perplexity of the default model on the GPL-3 text Debian ships (fornax/quality/perplexity.py),
  windows of 512 tokens, for dense bf16 and int8 / int4 / auto with every step through the
  quantized kernels (small_step_max_rows set above the window), w8a8 (int8 x int8 on every
  step) and auto+w8a8 (as served: the file's int4 at one row, int8 x int8 past it; here the
  scored prompts are all int8 x int8 and the greedy decode all int4); auto+w8a8+head4 adds the
  int4 LM head (--lm-head-quantization int4), which here scores every row;
- int8 K/V (--kv-cache-dtype int8): bf16 and auto+w8a8 with +kv8, prompts prefilled in chunks
  of 64 tokens so that each chunk reads the earlier ones from the cache (a lone prompt in one
  chunk attends to its fresh K/V and would never read the int8 rows); "bf16 c64" is bf16
  prefilled the same way, their anchor;
- greedy agreement: 32 new tokens for each of 24 chat prompts; each weight form against bf16
  (identical continuations, and the mean length of the common prefix), the +kv8 forms against
  the same form without, and bf16 against fp32.

    .venv/bin/python benchmarks/quantization_quality.py [--windows 16]
"""

from __future__ import annotations

import argparse
import gc

from fornax import LLM, SamplingParams
from fornax.quality.perplexity import load_corpus, perplexity

QUESTIONS = [
    "What is LLM inference?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about rain.",
    "What is the capital of Australia?",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give three tips for better sleep.",
    "What is a prime number?",
    "Summarize the plot of Hamlet.",
    "How does a refrigerator work?",
    "Translate 'good morning' into French.",
    "What causes tides?",
    "Name the planets of the solar system.",
    "What is the difference between RAM and disk?",
    "Write a SQL query that counts rows in a table named users.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "What is recursion?",
    "List four primary colors of light and pigment.",
    "Why do we have seasons?",
    "What does HTTP stand for?",
    "Give me a short motivational quote.",
    "How do vaccines work?",
    "What is the boiling point of water at sea level?",
]
ALL_ROWS = 1 << 30


def greedy(llm: LLM, new_tokens: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # One at a time: bf16 results can depend on the batch's shape, and that is not what this measures.
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b)]
    return same, sum(prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--windows", type=int, default=None, help="limit the number of 512-token windows")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--forms", default=None, help="only these forms (comma-separated; bf16, the anchor, always runs)"
    )
    args = ap.parse_args()
    text = load_corpus()

    rows = []
    outputs = {}
    forms = [
        (name, {"quantization": q, "small_step_max_rows": ALL_ROWS if q else 24})
        for name, q in (("bf16", None), ("int8", "int8"), ("int4", "int4"), ("auto", "auto"))
    ]
    # int8 x int8 on every step, and as served: the file's int4 for one-row steps, int8 x int8 past them
    forms.append(("w8a8", {"small_step_max_rows": 0, "large_step_quantization": "w8a8"}))
    forms.append(("auto+w8a8", {"quantization": "auto", "large_step_quantization": "w8a8"}))
    # ... with the int4 LM head (--lm-head-quantization int4), here on every row, scoring included
    forms.append(
        (
            "auto+w8a8+head4",
            {"quantization": "auto", "large_step_quantization": "w8a8", "lm_head_quantization": "int4"},
        )
    )
    chunked = {"max_num_batched_tokens": 64}
    forms.append(("bf16 c64", chunked))
    forms.append(("bf16+kv8", {**chunked, "kv_cache_dtype": "int8"}))
    forms.append(
        (
            "auto+w8a8+kv8",
            {**chunked, "quantization": "auto", "large_step_quantization": "w8a8", "kv_cache_dtype": "int8"},
        )
    )
    if args.forms:
        wanted = {"bf16", *args.forms.split(",")}
        forms = [(name, kwargs) for name, kwargs in forms if name in wanted]
    for name, kwargs in forms:
        llm = LLM(args.model, progress=False, max_model_len=2048, **kwargs)
        if kwargs.get("lm_head_quantization"):
            llm.engine.runner.model.lm_head.small_max_rows = ALL_ROWS
        ppl = perplexity(llm, text, window=512, max_windows=args.windows)
        outputs[name] = greedy(llm, args.new_tokens)
        rows.append((name, ppl))
        print(f"{name}: perplexity {ppl.perplexity:.3f} over {ppl.num_scored_tokens} tokens", flush=True)
        del llm
        gc.collect()
    fp32 = greedy(LLM(args.model, dtype="float32", progress=False, max_model_len=2048), args.new_tokens)

    base = rows[0][1].perplexity
    print()
    print(
        f"perplexity, GPL-3 text, {rows[0][1].num_windows} windows of 512 tokens "
        f"({rows[0][1].num_scored_tokens} scored):"
    )
    print(f"{'form':<13} {'perplexity':>10} {'vs bf16':>8}")
    for name, ppl in rows:
        print(f"{name:<13} {ppl.perplexity:>10.3f} {ppl.perplexity / base - 1:>+8.2%}")
    print()
    n = len(QUESTIONS)
    print(f"greedy agreement, {n} chat prompts x {args.new_tokens} new tokens (each prompt alone):")
    for name in (n for n in ("int8", "int4", "auto", "w8a8", "auto+w8a8", "auto+w8a8+head4") if n in outputs):
        same, prefix = agreement(outputs[name], outputs["bf16"])
        print(f"  {name} vs bf16: {same}/{n} identical, mean common prefix {prefix:.1f} tokens")
    for name, anchor in (("bf16+kv8", "bf16"), ("auto+w8a8+kv8", "auto+w8a8")):
        if name not in outputs or anchor not in outputs:
            continue
        same, prefix = agreement(outputs[name], outputs[anchor])
        print(f"  {name} vs {anchor}: {same}/{n} identical, mean common prefix {prefix:.1f} tokens")
    same, prefix = agreement(outputs["bf16"], fp32)
    print(f"  bf16 vs fp32: {same}/{n} identical, mean common prefix {prefix:.1f} tokens")


if __name__ == "__main__":
    main()
