"""Speed of each supported model side by side, in one process, with `make run`'s weight forms:
decode tokens/s at 1 stream and at 8 streams, and the time to prefill a 512-token prompt.

Each model's engine is loaded once; the measurements then alternate between the models for
`--rounds` rounds and the medians are printed, so that the machine's drift touches each alike.

    .venv/bin/python benchmarks/model_speed.py [--models smollm2-135m-instruct,gemma3-270m,gemma3-270m:head4]

(NAME:head4: the model with `--lm-head-quantization int4`.)
"""

from __future__ import annotations

import argparse
import statistics
import time

from fornax import LLM, SamplingParams

MAKE_RUN = {"quantization": "auto", "large_step_quantization": "w8a8"}


def decode_rate(llm: LLM, streams: int, new_tokens: int) -> float:
    """Generated tokens per second over all streams; prompts of ~16 tokens, prefill included
    (small next to the decode)."""
    prompts = [f"Request {i}: write a long story about a lighthouse keeper." for i in range(streams)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return streams * new_tokens / (time.perf_counter() - start)


def prefill_seconds(llm: LLM, tokens: int, salt: int) -> float:
    """One fresh prompt of `tokens` tokens and one new token (its first token's latency)."""
    tok = llm.get_tokenizer()
    ids = tok.encode(f"{salt} " + "the quick brown fox jumps over the lazy dog " * (tokens // 4))[:tokens]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    llm.generate([ids], params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m,gemma3-270m:head4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    names = args.models.split(",")
    # NAME:head4 is NAME with --lm-head-quantization int4
    llms = {
        name: LLM(
            name.removesuffix(":head4"),
            progress=False,
            max_model_len=2048,
            **MAKE_RUN,
            lm_head_quantization="int4" if name.endswith(":head4") else None,
        )
        for name in names
    }
    for llm in llms.values():  # warm-up: kernels, allocator, first-call paths
        decode_rate(llm, 2, 8)
        prefill_seconds(llm, 64, -1)
    results: dict[str, dict[str, list[float]]] = {n: {"1": [], "8": [], "prefill": []} for n in names}
    for r in range(args.rounds):
        for name, llm in llms.items():
            results[name]["1"].append(decode_rate(llm, 1, args.new_tokens))
            results[name]["8"].append(decode_rate(llm, 8, args.new_tokens))
            results[name]["prefill"].append(prefill_seconds(llm, 512, r))
    print(f"{'model':<26} {'decode 1 stream':>16} {'decode 8 streams':>17} {'prefill 512':>12}")
    for name in names:
        m = {k: statistics.median(v) for k, v in results[name].items()}
        print(f"{name:<26} {m['1']:>12.1f} t/s {m['8']:>13.1f} t/s {m['prefill'] * 1000:>9.0f} ms")


if __name__ == "__main__":
    main()
