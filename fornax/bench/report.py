"""Turn per-request results into the summary numbers, the printed tables and the JSON report.

Definitions (latencies in ms, over successful requests only):
  request throughput      completed / duration
  output token throughput sum(output_tokens) / duration
  total token throughput  sum(prompt_tokens + output_tokens) / duration
  TTFT                    per request, send -> first generated text
  TPOT                    per request with >= 2 output tokens, (E2E - TTFT) / (output_tokens - 1)
  ITL                     every gap between consecutive text chunks, pooled over all requests
  E2E                     per request, send -> end of stream
  goodput                 completed requests that meet every given SLO, / duration
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fornax.bench import BenchUsageError
from fornax.bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Stats:
    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of_seconds(cls, values: list[float]) -> Stats:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), len(values))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    goodput: float | None  # req/s meeting all SLOs; None when no SLO was given
    good_requests: int | None
    slos_ms: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return _clean(asdict(self))


def _clean(obj: Any) -> Any:
    """NaN -> None so the JSON report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise BenchUsageError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise BenchUsageError(f"--goodput {key}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or not math.isfinite(ms):
            raise BenchUsageError(f"--goodput {key}: the SLO must be a positive number of ms, got {value!r}")
        slos[key] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (a 1-token answer has TPOT 0)."""
    if not r.success or r.ttft_s is None or r.e2el_s is None:
        return False
    measured = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
    return all(measured[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def summarize(
    results: list[RequestResult], duration_s: float, slos_ms: dict[str, float] | None = None
) -> Summary:
    ok = [r for r in results if r.success]
    slos_ms = slos_ms or {}
    dur = duration_s if duration_s > 0 else math.nan
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / dur,
        output_throughput=output_tokens / dur,
        total_token_throughput=(prompt_tokens + output_tokens) / dur,
        ttft_ms=Stats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=Stats.of_seconds([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=Stats.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el_ms=Stats.of_seconds([r.e2el_s for r in ok if r.e2el_s is not None]),
        goodput=None if good is None else good / dur,
        good_requests=good,
        slos_ms=dict(slos_ms),
    )


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def format_table(s: Summary, title: str = "Serving benchmark") -> str:
    rows: list[tuple[str, str]] = [
        ("Completed requests", str(s.completed)),
        ("Failed requests", str(s.failed)),
        ("Duration (s)", _fmt(s.duration_s)),
        ("Total prompt tokens", str(s.total_prompt_tokens)),
        ("Total output tokens", str(s.total_output_tokens)),
        ("Request throughput (req/s)", _fmt(s.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(s.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(s.total_token_throughput)),
    ]
    if s.goodput is not None:
        slo_text = " ".join(f"{k}<={v:g}ms" for k, v in s.slos_ms.items())
        rows.append((f"Goodput (req/s) [{slo_text}]", _fmt(s.goodput)))
        rows.append(("Requests meeting SLOs", f"{s.good_requests}/{s.completed + s.failed}"))
    width = max(48, max(len(k) for k, _ in rows) + 14)
    lines = [f" {title} ".center(width, "=")]
    lines += [f"{k:<{width - 12}}{v:>12}" for k, v in rows]
    header = f"{'(ms)':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"
    lines.append("-" * width)
    lines.append(header)
    for name, st in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2el_ms)):
        lines.append(f"{name:<10}" + "".join(f"{_fmt(v):>10}" for v in (st.mean, st.median, st.p90, st.p99)))
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep_table(levels: list[tuple[int, Summary]]) -> str:
    cols = (
        "concurrency",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "E2E p50",
    )
    lines = ["".join(f"{c:>12}" for c in cols), "-" * 12 * len(cols)]
    for conc, s in levels:
        vals = (
            str(conc),
            str(s.completed),
            str(s.failed),
            _fmt(s.request_throughput),
            _fmt(s.output_throughput, 1),
            _fmt(s.ttft_ms.median, 1),
            _fmt(s.ttft_ms.p99, 1),
            _fmt(s.tpot_ms.median, 1),
            _fmt(s.itl_ms.median, 1),
            _fmt(s.e2el_ms.median, 1),
        )
        lines.append("".join(f"{v:>12}" for v in vals))
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def run_report(config: dict[str, Any], summary: Summary, results: list[RequestResult]) -> dict[str, Any]:
    """One run as a JSON-ready dict: the settings, the summary and every request."""
    requests = [r.to_dict() for r in results]
    return _clean({"config": config, "summary": summary.to_dict(), "requests": requests})
