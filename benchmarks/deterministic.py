"""What deterministic mode costs: `fornax serve` with and without --deterministic, side by side,
at 1 and 32 concurrent streams, for each weight form asked.

Each round starts one server per side in turn (alternating which goes first) and drives it with
`fornax bench serve` on the random dataset (~128-token prompts, 128 output tokens, EOS ignored;
2 requests per stream, 2 warm-ups). Prints each side's output tok/s per round, the medians and
the ratio deterministic / default (1.00: no cost).

    .venv/bin/python benchmarks/deterministic.py --rounds 3
    .venv/bin/python benchmarks/deterministic.py --forms make-run --streams 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _servers import MAKE_RUN_FLAGS, Process  # benchmarks/ is on sys.path when run as a script

FORMS = {
    "bf16": [],
    "make-run": list(MAKE_RUN_FLAGS),
}
KEY = "sk-deterministic-bench"


def _serve_and_bench(flags: list[str], streams: int, log_dir: Path) -> float:
    """Output tok/s of one fresh server under `streams` concurrent streams."""
    args = ["serve", "--api-key", KEY, "--max-num-seqs", "64", "--log-level", "warning", *flags]
    server = Process("serve", args, log_dir)
    try:
        server.wait_ready(lambda r: r.status_code == 200)
        out = log_dir / "bench.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fornax.cli",
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--api-key",
                KEY,
                "--dataset",
                "random",
                "--random-input-len",
                "128",
                "--random-output-len",
                "128",
                "--num-prompts",
                str(2 * streams),
                "--num-warmups",
                "2",
                "--max-concurrency",
                str(streams),
                "--seed",
                "0",
                "--no-progress",
                "--json",
                str(out),
            ],
            check=True,
            capture_output=True,  # its progress lines; its summary is read from the JSON
        )
        summary = json.loads(out.read_text())["summary"]
        if summary.get("failed"):
            raise RuntimeError(f"{summary['failed']} requests failed")
        return float(summary["output_throughput"])
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default="bf16,make-run", help=f"comma-separated, of {', '.join(FORMS)}")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="fornax-deterministic-"))
    print(
        f"{'form':>9}  {'streams':>7}  {'default tok/s':>24}  {'deterministic tok/s':>24}  {'det / default':>13}"
    )
    for form in args.forms.split(","):
        for streams in map(int, args.streams.split(",")):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(args.rounds):
                order = (False, True) if round_ % 2 == 0 else (True, False)
                for det in order:
                    flags = FORMS[form] + (["--deterministic"] if det else [])
                    runs[det].append(_serve_and_bench(flags, streams, log_dir))
            base, det = statistics.median(runs[False]), statistics.median(runs[True])
            each = {k: "/".join(f"{v:.0f}" for v in vs) for k, vs in runs.items()}
            print(
                f"{form:>9}  {streams:>7}  {base:>8.1f} ({each[False]:>13})  {det:>8.1f} ({each[True]:>13})"
                f"  {det / base:>12.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
