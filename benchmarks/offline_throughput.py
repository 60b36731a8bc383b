"""Offline speed: fornax (each weight form) against HF transformers, in one run.

One seeded workload (prompts of real-ish English text, 32-512 tokens; outputs 64-256 tokens,
EOS ignored) goes through both engines in bf16 on the same GGUF:

  fornax   LLM.generate(all requests at once): the scheduler packs them into steps.
  HF       static batches of --hf-batch-size, left-padded; every batch runs until its
           longest request is done (min_new_tokens = max_new_tokens = that maximum), so a
           short request's extra tokens are wasted work. Only the tokens each request asked
           for count as useful output.

Then, for each engine and weight form (--quantization, e.g. none,int8,int4,auto,auto+w8a8):
  single-stream decode: one 128-token prompt, 128 new tokens, prefill excluded;
  long-context decode: the same after a 2,000-token prompt (fornax only); the two alternate
  --decode-repeats times, each figure is the median, and the 2k slowdown is the median of
  the ratios of adjacent pairs (a lone 128-token run varied by 30% within one run);
  prefill: a lone 512-token prompt, time to its first token (median of 3 fresh prompts).

    python benchmarks/offline_throughput.py --quick
    python benchmarks/offline_throughput.py --quantization none,int8,int4 --json out.json

This is a measurement script, not a test. Quote ratios, not absolute numbers: the machine
is shared and its speed varies from run to run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fornax import LLM, SamplingParams
from fornax.models.registry import resolve_model

TEXT = [
    "Every morning the ferry crossed the bay twice, carrying commuters, bicycles and crates of "
    "vegetables from the farms on the far shore to the market that opened beside the pier.",
    "Modern processors hide memory latency behind deep caches and aggressive prefetching, yet a "
    "program that jumps randomly through a large array still spends most of its time waiting.",
    "The expedition reached the pass at dusk. Snow had drifted across the trail, and the guides "
    "decided to camp below the ridge rather than risk the descent in failing light.",
    "Gardeners who keep notes learn a great deal: which seeds sprouted late, which beds flooded, "
    "and which varieties survived the first frost that arrived earlier than anyone had predicted.",
    "A well-written function does one thing, has a name that says what that thing is, and can be "
    "understood without reading the rest of the file in which it happens to live.",
    "During the festival the square filled with stalls selling roasted nuts, woven baskets and "
    "painted masks, while musicians played on a wooden stage until long after midnight.",
    "Tides are driven mainly by the moon's gravity, with the sun adding a smaller pull; when the "
    "two line up, the difference between high and low water is at its greatest.",
    "The museum's newest room holds instruments once used to measure the stars: brass astrolabes, "
    "a cracked telescope lens, and notebooks filled with columns of careful numbers.",
]


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    engine: str
    seconds: float
    useful_output_tokens: int
    prompt_tokens: int
    generated_tokens: int  # including HF's padding-to-the-longest waste
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.output_tok_s = self.useful_output_tokens / self.seconds
        self.total_tok_s = (self.useful_output_tokens + self.prompt_tokens) / self.seconds


def build_workload(
    tokenizer, num_prompts: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> Workload:
    """Seeded prompts cut from a shuffled stream of the paragraphs, at uniform random lengths."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_prompts):
        length = rng.randint(*prompt_range)
        ids: list[int] = []
        while len(ids) < length:
            ids.extend(tokenizer.encode(" ".join(rng.sample(TEXT, len(TEXT)))))
        prompts.append(ids[:length])
        output_lens.append(rng.randint(*output_range))
    return Workload(prompts, output_lens)


# -- fornax --


def run_fornax(llm: LLM, work: Workload) -> Result:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == work.output_tokens, f"fornax produced {produced}, expected {work.output_tokens}"
    preemptions = float(llm.engine.scheduler.num_preemptions_total)
    return Result("fornax", seconds, produced, work.prompt_tokens, produced, {"preemptions": preemptions})


def fornax_single_stream(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s of one request alone: tokens after the first over the time after the first."""
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[0]
    return (len(out.outputs[0].token_ids) - 1) / out.timings["decode_s"]


def fornax_decode_pairs(
    llm: LLM, short: list[int], long: list[int], new_tokens: int, repeats: int
) -> dict[str, float]:
    """Single-stream decode after a short and a long prompt, alternating: the medians, and the
    median ratio of adjacent pairs (so the machine's drift hits both sides of each ratio)."""
    short_rates, long_rates = [], []
    for _ in range(repeats):
        short_rates.append(fornax_single_stream(llm, short, new_tokens))
        long_rates.append(fornax_single_stream(llm, long, new_tokens))
    ratios = [s / lo for s, lo in zip(short_rates, long_rates)]
    return {
        "decode": statistics.median(short_rates),
        "decode_2k": statistics.median(long_rates),
        "slowdown_2k": statistics.median(ratios),
    }


def fornax_prefill(llm: LLM, prompts: list[list[int]]) -> float:
    """Prompt tok/s of a lone prompt (median over distinct prompts, so no prefix-cache hits)."""
    rates = []
    for p in prompts:
        out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
        rates.append(len(p) / out.timings["prefill_s"])
    return statistics.median(rates)


# -- HF transformers --


def load_hf(gguf: Path):
    """Dense bf16 weights (the file dequantized), like fornax's prefill path. transformers can
    also keep GGUF blocks packed; on this machine that decoded at the same speed (18.8 vs
    18.7 tok/s single-stream, one run), so the dense form is the anchor."""
    from transformers import AutoModelForCausalLM, GgufConfig

    config = GgufConfig(gguf_file=gguf.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=config
    )
    model.generation_config.eos_token_id = None  # EOS is ignored on both sides
    return model.eval()


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    ids, mask = _left_padded(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, ids.shape[1] :]


def run_hf(model, work: Workload, batch_size: int, pad_id: int) -> Result:
    _hf_generate(model, [[1, 2, 3, 4]], 4, pad_id)  # warm-up
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        batch = work.prompts[i : i + batch_size]
        longest = max(work.output_lens[i : i + batch_size])
        new = _hf_generate(model, batch, longest, pad_id)
        assert new.shape[1] == longest
        generated += new.numel()
    seconds = time.perf_counter() - start
    return Result("hf", seconds, work.output_tokens, work.prompt_tokens, generated)


def hf_prefill(model, prompts: list[list[int]], pad_id: int) -> float:
    """Prompt tok/s: generate() of one token, which is the prefill plus one sampling step."""
    rates = []
    for p in prompts:
        start = time.perf_counter()
        _hf_generate(model, [p], 1, pad_id)
        rates.append(len(p) / (time.perf_counter() - start))
    return statistics.median(rates)


def hf_single_stream(model, prompt: list[int], new_tokens: int, pad_id: int) -> float:
    """Decode tok/s: (time for N tokens - time for 1 token, i.e. the prefill) over N - 1 tokens."""
    start = time.perf_counter()
    _hf_generate(model, [prompt], 1, pad_id)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    _hf_generate(model, [prompt], new_tokens, pad_id)
    total = time.perf_counter() - start
    return (new_tokens - 1) / max(total - prefill, 1e-9)


# -- report --


def print_table(work: Workload, results: list[tuple[str, Result, dict[str, float]]]) -> None:
    print()
    print(
        f"workload: {len(work.prompts)} requests, {work.prompt_tokens} prompt tokens, "
        f"{work.output_tokens} requested output tokens (EOS ignored)"
    )
    width = max(14, *(len(name) for name, _, _ in results))
    header = (
        f"{'engine':<{width}} {'batch out tok/s':>15} {'total tok/s':>12} {'wasted':>7} {'decode 1x':>10} "
        f"{'decode @2k':>11} {'2k slowdown':>12} {'prefill 512':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, r, single in results:
        wasted = 1 - r.useful_output_tokens / r.generated_tokens
        long = single.get("decode_2k")
        slow = f"{single['slowdown_2k']:>11.2f}x" if long else f"{'-':>12}"
        print(
            f"{name:<{width}} {r.output_tok_s:>15.1f} {r.total_tok_s:>12.1f} {wasted:>6.0%} "
            f"{single['decode']:>10.1f} {long or 0:>11.1f} {slow} {single['prefill']:>12.1f}"
        )
    hf = next((x for x in results if x[0] == "hf"), None)
    if hf:
        print()
        print("ratios to HF transformers (batch output tok/s, single-stream decode, prefill):")
        for name, r, single in results:
            if name != "hf":
                print(
                    f"  {name:<{width}} x{r.output_tok_s / hf[1].output_tok_s:.2f}  "
                    f"x{single['decode'] / hf[2]['decode']:.2f}  "
                    f"x{single['prefill'] / hf[2]['prefill']:.2f}"
                )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias or path of a GGUF file")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests in the workload (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 12 requests instead of 64")
    ap.add_argument("--skip-hf", action="store_true", help="measure fornax only")
    ap.add_argument(
        "--quantization",
        default="none,int4",
        help="fornax weight forms, comma-separated: none,int8,int4,auto for the small (decode) steps, "
        "each optionally +w8a8 for the larger ones (auto+w8a8) and +kv8 for int8 K/V "
        "(--kv-cache-dtype int8: auto+w8a8+kv8)",
    )
    ap.add_argument("--kernel-backend", default="native", choices=["native", "torch"])
    ap.add_argument(
        "--decode-repeats", type=int, default=3, help="single-stream decode runs per prompt length"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    num_prompts = args.num_prompts or (12 if args.quick else 64)
    single_tokens = 128
    gguf = Path(args.model) if args.model.endswith(".gguf") else resolve_model(args.model).gguf_path
    assert gguf is not None, f"{args.model} does not resolve to a GGUF file"

    results: list[tuple[str, Result, dict[str, float]]] = []
    work = None
    for form in args.quantization.split(","):
        small, *extras = form.split("+")  # e.g. "auto+w8a8+kv8": int8 x int8 past the small steps, int8 K/V
        if set(extras) - {"w8a8", "kv8"}:
            ap.error(f"unknown part in {form!r}: the parts after + are w8a8 and kv8")
        quant = None if small == "none" else small
        large = "w8a8" if "w8a8" in extras else None
        kv_cache_dtype = "int8" if "kv8" in extras else "auto"
        llm = LLM(
            str(gguf),
            dtype="bfloat16",
            quantization=quant,
            large_step_quantization=large,
            kv_cache_dtype=kv_cache_dtype,
            kernel_backend=args.kernel_backend,
            progress=False,
        )
        tok = llm.get_tokenizer()
        work = build_workload(tok, num_prompts, args.seed, (32, 512), (64, 256))
        single_prompt = build_workload(tok, 1, args.seed + 1, (128, 128), (1, 1)).prompts[0]
        long_prompt = build_workload(tok, 1, args.seed + 2, (2000, 2000), (1, 1)).prompts[0]
        prefill_prompts = build_workload(tok, 3, args.seed + 3, (512, 512), (1, 1)).prompts
        name = f"fornax {form}"
        print(f"{name}: {num_prompts} requests ...", flush=True)
        result = run_fornax(llm, work)
        single = fornax_decode_pairs(llm, single_prompt, long_prompt, single_tokens, args.decode_repeats)
        single["prefill"] = fornax_prefill(llm, prefill_prompts)
        results.append((name, result, single))
        del llm
        gc.collect()

    assert work is not None
    if not args.skip_hf:
        print(f"hf transformers: batches of {args.hf_batch_size} ...", flush=True)
        model = load_hf(gguf)
        pad_id = int(next(iter(tok.eos_token_ids)))  # masked out; any id works
        hf = run_hf(model, work, args.hf_batch_size, pad_id)
        single = {
            "decode": hf_single_stream(model, single_prompt, single_tokens, pad_id),
            "prefill": hf_prefill(model, prefill_prompts, pad_id),
        }
        results.append(("hf", hf, single))

    print_table(work, results)
    if args.json:
        report = {
            "num_prompts": num_prompts,
            "seed": args.seed,
            "quick": args.quick,
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "single_stream_new_tokens": single_tokens,
            "results": [{"engine": n, "batch": asdict(r), **single} for n, r, single in results],
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
