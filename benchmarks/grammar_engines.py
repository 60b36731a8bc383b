"""xgrammar vs llguidance for fornax's structured outputs, on the default model's vocabulary
(SmolLM2-135M-Instruct, 49,152 tokens) and the 20 JSON schemas of tests/structured/schemas.py.

Measured, in one process, for both engines:
  a. Setup, once: the raw bytes of every token (shared by both), xgrammar's TokenizerInfo and a
     GrammarCompiler, llguidance's LLTokenizer.
  b. Compile, per schema, cold: xgrammar compiles with a fresh GrammarCompiler (cache disabled,
     max_threads=1) each time; llguidance compiles lazily, so its "construct" (grammar_from_json_schema
     + LLMatcher) is reported apart from its "first mask" (the first fill_next_token_bitmask), and
     xgrammar's the same way (compile_json_schema + GrammarMatcher, then its first mask). "total"
     is their sum: the latency a request adds before its first constrained token. Per schema, the
     median over repeats; then the median and max over schemas.
  c. Per token: each schema's valid example is tokenized and walked token by token, then EOS
     (fill the mask, accept the token). Each mask after the first one is a sample (the first is
     b's "first mask"): median and p90 over all samples of all runs, and the mean as the median
     over runs of each run's mean. "mask+accept" adds the time to accept the token.

Engines alternate per schema (xgrammar first on even schemas of even runs, llguidance first
otherwise) so machine noise falls on both alike; every run is preceded by an untimed warm-up
pass; the garbage collector is off while a schema is timed. Times are time.perf_counter.
The bitmask is a CPU int32 tensor for both, as a server would fill it.

Special tokens: the xgrammar vocabulary has the non-stop special tokens blanked, and llguidance
is given their ids, so neither lets "<|im_start|>" be written inside a JSON string
(tests/structured/engines.py says why).

    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/grammar_engines.py --repeats 3
    FORNAX_HOME=/tmp/fhome .venv/bin/python benchmarks/grammar_engines.py --repeats 10 --json engines.json

Exit status: 0, or 1 if an engine rejected a corpus example (then the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.structured.engines import Vocab, llguidance_tokenizer, xgrammar_tokenizer_info
from tests.structured.schemas import SCHEMAS

ENGINES = ("xgrammar", "llguidance")


@dataclass
class Walk:
    """One engine on one schema, once."""

    construct_s: float
    first_mask_s: float
    masks_s: list[float] = field(default_factory=list)  # every mask after the first
    accepts_s: list[float] = field(default_factory=list)  # accepting the token that followed each

    @property
    def total_s(self) -> float:
        return self.construct_s + self.first_mask_s


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, setup: dict[str, float]) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        start = time.perf_counter()
        self.info = xgrammar_tokenizer_info(vocab)
        setup["xgrammar TokenizerInfo"] = time.perf_counter() - start
        start = time.perf_counter()
        xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        setup["xgrammar GrammarCompiler"] = time.perf_counter() - start
        self.bitmask = xgr.allocate_token_bitmask(1, vocab.size)

    def walk(self, schema: dict[str, Any], tokens: list[int]) -> Walk:
        xgr, bitmask = self.xgr, self.bitmask
        compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # cold, untimed
        text = json.dumps(schema)
        clock = time.perf_counter
        t0 = clock()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(text))
        t1 = clock()
        matcher.fill_next_token_bitmask(bitmask)
        t2 = clock()
        result = Walk(t1 - t0, t2 - t1)
        for n, token in enumerate(tokens):
            if n:
                t0 = clock()
                matcher.fill_next_token_bitmask(bitmask)
                t1 = clock()
                result.masks_s.append(t1 - t0)
            t1 = clock()
            ok = matcher.accept_token(token)
            t2 = clock()
            if n:
                result.accepts_s.append(t2 - t1)
            if not ok:
                raise RuntimeError(f"xgrammar rejected token {n} ({token})")
        if not matcher.is_terminated():
            raise RuntimeError("xgrammar did not terminate after EOS")
        return result


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, setup: dict[str, float]) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.fill, self.vocab = llguidance, llguidance.torch.fill_next_token_bitmask, vocab
        start = time.perf_counter()
        self.tokenizer = llguidance_tokenizer(vocab)
        setup["llguidance LLTokenizer"] = time.perf_counter() - start
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab.size)

    def walk(self, schema: dict[str, Any], tokens: list[int]) -> Walk:
        llg, fill, bitmask = self.llg, self.fill, self.bitmask
        text = json.dumps(schema)
        clock = time.perf_counter
        t0 = clock()
        matcher = llg.LLMatcher(self.tokenizer, llg.LLMatcher.grammar_from_json_schema(text), log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        t1 = clock()
        fill(matcher, bitmask)
        t2 = clock()
        result = Walk(t1 - t0, t2 - t1)
        for n, token in enumerate(tokens):
            if n:
                t0 = clock()
                fill(matcher, bitmask)
                t1 = clock()
                result.masks_s.append(t1 - t0)
            t1 = clock()
            ok = matcher.consume_token(token)
            t2 = clock()
            if n:
                result.accepts_s.append(t2 - t1)
            if not ok:
                raise RuntimeError(f"llguidance rejected token {n} ({token}): {matcher.get_error()}")
        if matcher.is_error() or not matcher.is_stopped():
            raise RuntimeError(f"llguidance did not stop after EOS: {matcher.get_error()}")
        return result


def timed_walk(engine: XGrammar | LLGuidance, schema: dict[str, Any], tokens: list[int]) -> Walk:
    gc.collect()
    gc.disable()
    try:
        return engine.walk(schema, tokens)
    finally:
        gc.enable()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(runs: list[list[Walk]]) -> dict[str, Any]:
    """runs[r][s]: one engine's walk of schema s in run r."""
    n_schemas = len(runs[0])

    def per_schema(attr: str) -> list[float]:
        return [statistics.median(getattr(run[s], attr) for run in runs) for s in range(n_schemas)]

    compile_ms = {}
    for attr in ("construct_s", "first_mask_s", "total_s"):
        values = per_schema(attr)
        compile_ms[attr[:-2]] = {
            "median": statistics.median(values) * 1e3,
            "max": max(values) * 1e3,
            "per_schema": [v * 1e3 for v in values],
        }

    def masks(w: Walk) -> list[float]:
        return w.masks_s

    def steps(w: Walk) -> list[float]:
        return [m + a for m, a in zip(w.masks_s, w.accepts_s)]

    per_token_us = {}
    for label, pick in (("mask", masks), ("mask+accept", steps)):
        samples = [x for run in runs for walk in run for x in pick(walk)]
        run_means = [statistics.fmean([x for walk in run for x in pick(walk)]) for run in runs]
        per_token_us[label] = {
            "median": statistics.median(samples) * 1e6,
            "p90": percentile(samples, 0.9) * 1e6,
            "mean": statistics.median(run_means) * 1e6,
            "samples": len(samples),
        }
    mean_mask_us = [
        statistics.median(statistics.fmean(run[s].masks_s) for run in runs) * 1e6 for s in range(n_schemas)
    ]
    # A whole request's grammar work: compile, first mask, then every later mask and accept.
    request = [
        statistics.median(run[s].total_s + sum(steps(run[s])) for run in runs) for s in range(n_schemas)
    ]
    return {
        "compile_ms": compile_ms,
        "per_token_us": per_token_us,
        "per_schema_mean_mask_us": mean_mask_us,
        "request_ms": {
            "median": statistics.median(request) * 1e3,
            "max": max(request) * 1e3,
            "per_schema": [v * 1e3 for v in request],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs over the corpus (default 5)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name of the model")
    parser.add_argument("--gguf", type=Path, help="a GGUF file to take the tokenizer from instead")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from fornax.tokenizer import Tokenizer

    if args.gguf is None:
        from fornax.models.registry import resolve_model

        args.gguf = resolve_model(args.model).gguf_path
    tokenizer = Tokenizer.from_gguf_file(args.gguf)
    setup: dict[str, float] = {}
    start = time.perf_counter()
    vocab = Vocab.from_tokenizer(tokenizer)
    setup["token bytes (shared)"] = time.perf_counter() - start
    engines = (XGrammar(vocab, setup), LLGuidance(vocab, setup))
    walks_tokens = [[*vocab.encode(json.dumps(example)), vocab.stop_ids[0]] for _, _, example in SCHEMAS]
    versions = {e.name: version(e.name) for e in engines}

    try:
        for engine in engines:  # warm-up, untimed; also checks every example is accepted
            for (_, schema, _), tokens in zip(SCHEMAS, walks_tokens):
                engine.walk(schema, tokens)
        runs: dict[str, list[list[Walk]]] = {e.name: [] for e in engines}
        for r in range(args.repeats):
            for e in engines:
                runs[e.name].append([])
            for s, ((_, schema, _), tokens) in enumerate(zip(SCHEMAS, walks_tokens)):
                for engine in engines if (s + r) % 2 == 0 else engines[::-1]:
                    runs[engine.name][r].append(timed_walk(engine, schema, tokens))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    summary = {name: summarize(engine_runs) for name, engine_runs in runs.items()}
    report(args, vocab, setup, summary, versions, walks_tokens)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "gguf": str(args.gguf),
                    "vocab_size": vocab.size,
                    "repeats": args.repeats,
                    "versions": versions,
                    "setup_ms": {k: v * 1e3 for k, v in setup.items()},
                    "schemas": [name for name, _, _ in SCHEMAS],
                    "tokens_per_walk": [len(t) for t in walks_tokens],
                    "summary": summary,
                },
                indent=2,
            )
        )
    return 0


def report(
    args: argparse.Namespace,
    vocab: Vocab,
    setup: dict[str, float],
    summary: dict[str, Any],
    versions: dict[str, str],
    walks_tokens: list[list[int]],
) -> None:
    tokens = sum(len(t) for t in walks_tokens)
    print(f"grammar engines: xgrammar {versions['xgrammar']} vs llguidance {versions['llguidance']}")
    print(
        f"vocabulary {vocab.size} tokens ({Path(args.gguf).name}); {len(SCHEMAS)} schemas, "
        f"{tokens} tokens per pass incl. EOS; {args.repeats} timed runs after a warm-up\n"
    )
    print("setup (one-off)                 ms")
    for label, seconds in setup.items():
        print(f"  {label:28s} {seconds * 1e3:8.1f}")
    print("\ncompile, per schema (ms)              median      max")
    for name in ENGINES:
        for part in ("construct", "first_mask", "total"):
            stats = summary[name]["compile_ms"][part]
            print(f"  {name:11s} {part.replace('_', ' '):18s} {stats['median']:10.3f} {stats['max']:8.3f}")
    print("\nper token (us)                        median      p90     mean  samples")
    for name in ENGINES:
        for part in ("mask", "mask+accept"):
            stats = summary[name]["per_token_us"][part]
            print(
                f"  {name:11s} {part:18s} {stats['median']:10.1f} {stats['p90']:8.1f} {stats['mean']:8.1f}"
                f" {stats['samples']:8d}"
            )
    x, g = summary["xgrammar"], summary["llguidance"]
    print("\nwhole request (total compile + later masks and accepts), ms   median      max")
    for name in ENGINES:
        stats = summary[name]["request_ms"]
        print(f"  {name:57s} {stats['median']:10.3f} {stats['max']:8.3f}")
    print("\nper schema                  tokens  total compile ms      mean mask us      request ms")
    print("                                    xgrammar llguidance  xgrammar llguidance  xgrammar llguidance")
    for s, (name, _, _) in enumerate(SCHEMAS):
        xc, gc_ = x["compile_ms"]["total"]["per_schema"][s], g["compile_ms"]["total"]["per_schema"][s]
        xm, gm = x["per_schema_mean_mask_us"][s], g["per_schema_mean_mask_us"][s]
        xr, gr = x["request_ms"]["per_schema"][s], g["request_ms"]["per_schema"][s]
        print(
            f"  {name:24s} {len(walks_tokens[s]):6d} {xc:9.2f} {gc_:10.2f} {xm:9.1f} {gm:10.1f}"
            f" {xr:9.2f} {gr:10.2f}"
        )
    mask = g["per_token_us"]["mask"]["mean"] / x["per_token_us"]["mask"]["mean"]
    step = g["per_token_us"]["mask+accept"]["mean"] / x["per_token_us"]["mask+accept"]["mean"]
    compile_ = g["compile_ms"]["total"]["median"] / x["compile_ms"]["total"]["median"]
    request = g["request_ms"]["median"] / x["request_ms"]["median"]
    step_gap_s = (g["per_token_us"]["mask+accept"]["mean"] - x["per_token_us"]["mask+accept"]["mean"]) / 1e6
    compile_gap_s = (x["compile_ms"]["total"]["median"] - g["compile_ms"]["total"]["median"]) / 1e3
    even = f"{compile_gap_s / step_gap_s:.0f} tokens" if step_gap_s > 0 and compile_gap_s > 0 else "n/a"
    print(
        f"\nratio llguidance/xgrammar: per-token mask mean {mask:.2f}x, mask+accept mean {step:.2f}x, "
        f"compile total median {compile_:.2f}x, whole request median {request:.2f}x; "
        f"break-even output length (median compile, mean step) {even}"
    )


if __name__ == "__main__":
    sys.exit(main())
