"""Model load time: fornax vs transformers on the same cached GGUF, side by side in one run.

Each load runs in a fresh Python process (imports included, as a user would see it),
alternating fornax and transformers, and the medians and their ratio are printed.

    .venv/bin/python benchmarks/load_time.py [--model smollm2-135m-instruct] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

FORNAX = """
import time, sys
t = time.perf_counter()
from fornax.models import load_model
from fornax.tokenizer import Tokenizer
m = load_model(sys.argv[1], "bfloat16", progress=False)
Tokenizer.from_gguf_metadata(m.metadata)
print(time.perf_counter() - t)
"""
HF = """
import time, sys, pathlib
t = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
p = pathlib.Path(sys.argv[1])
AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.bfloat16)
AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
print(time.perf_counter() - t)
"""


def timed(script: str, path: str) -> float:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, check=True)
    inner = float(out.stdout.strip().splitlines()[-1])
    return min(inner, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from fornax.models.registry import resolve_model

    path = str(resolve_model(args.model).gguf_path)
    ours, theirs = [], []
    for i in range(args.runs):
        ours.append(timed(FORNAX, path))
        theirs.append(timed(HF, path))
        print(f"run {i + 1}: fornax {ours[-1]:.2f} s   transformers {theirs[-1]:.2f} s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(
        f"median load (model + tokenizer, from the cached GGUF, imports included): "
        f"fornax {a:.2f} s, transformers {b:.2f} s, ratio {b / a:.1f}x"
    )


if __name__ == "__main__":
    main()
