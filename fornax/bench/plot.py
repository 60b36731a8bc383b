"""PNG charts of a run (latency CDFs, throughput over time) and of a concurrency sweep.

matplotlib is imported lazily with the Agg backend, so a run without --plot never pays for it
and no display is ever needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fornax.bench.client import RequestResult
from fornax.bench.report import Summary


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_s: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_s:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ms = np.sort(np.asarray(values_s)) * 1000.0
    ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
    for q, style in ((50, "--"), (99, ":")):
        x = float(np.percentile(ms, q))
        ax.axvline(x, linestyle=style, color="gray", linewidth=1)
        ax.annotate(f"p{q} {x:.1f}", (x, 0.05 if q == 50 else 0.15), fontsize=8, color="gray")


def _token_times(results: list[RequestResult]) -> np.ndarray:
    """Arrival times (s after the run's start) of generated tokens, spreading usage over chunks."""
    times: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for r in results:
        if not r.success or r.ttft_s is None:
            continue
        t = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.append(t)
        weights.append(np.full(len(t), r.output_tokens / max(1, len(t))))
    if not times:
        return np.zeros((2, 0))
    return np.vstack([np.concatenate(times), np.concatenate(weights)])


def _throughput_panel(ax: Any, results: list[RequestResult], summary: Summary) -> None:
    ax.set_title("Throughput and latency over the run")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tok/s", color="tab:blue")
    ax.grid(alpha=0.3)
    tw = _token_times(results)
    span = max(summary.duration_s, float(tw[0].max()) if tw.shape[1] else 0.0, 1e-3)
    bins = max(1, min(60, math.ceil(span / 0.25)))
    edges = np.linspace(0.0, span, bins + 1)
    hist, _ = np.histogram(tw[0], bins=edges, weights=tw[1])
    ax.plot((edges[:-1] + edges[1:]) / 2, hist / np.diff(edges), color="tab:blue", label="output tok/s")
    ok = [r for r in results if r.success and r.e2el_s is not None]
    twin = ax.twinx()
    twin.set_ylabel("E2E latency per request (ms)", color="tab:red")
    twin.scatter(
        [r.start_s for r in ok],
        [(r.e2el_s or 0.0) * 1000 for r in ok],
        s=8,
        color="tab:red",
        alpha=0.6,
        label="E2E (by send time)",
    )
    failed = [r.start_s for r in results if not r.success]
    if failed:
        twin.scatter(failed, [0.0] * len(failed), marker="x", color="black", label="failed")
    twin.legend(loc="upper right", fontsize=8)


def plot_run(results: list[RequestResult], summary: Summary, path: str | Path, title: str = "") -> None:
    """2x2 figure: TTFT, ITL and E2E latency CDFs, and throughput/latency over time."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ok = [r for r in results if r.success]
    _cdf(axes[0][0], [r.ttft_s for r in ok if r.ttft_s is not None], "TTFT CDF")
    _cdf(axes[0][1], [g for r in ok for g in r.itl_s], "ITL CDF")
    _cdf(axes[1][0], [r.e2el_s for r in ok if r.e2el_s is not None], "E2E latency CDF")
    _throughput_panel(axes[1][1], results, summary)
    fig.suptitle(
        title
        or f"{summary.completed} ok / {summary.failed} failed, {summary.output_throughput:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(levels: list[tuple[int, Summary]], path: str | Path, title: str = "") -> None:
    """Output throughput against median TTFT and median TPOT, one labelled point per concurrency."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    x = [s.output_throughput for _, s in levels]
    for ax, name, ys in (
        (axes[0], "median TTFT (ms)", [s.ttft_ms.median for _, s in levels]),
        (axes[1], "median TPOT (ms)", [s.tpot_ms.median for _, s in levels]),
    ):
        ax.plot(x, ys, marker="o")
        for (conc, _), xi, yi in zip(levels, x, ys):
            if math.isfinite(xi) and math.isfinite(yi):
                ax.annotate(f"c={conc}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output token throughput (tok/s)")
        ax.set_ylabel(name)
        ax.set_title(f"{name} vs throughput")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Concurrency sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
