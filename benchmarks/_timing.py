"""Timing shared by the micro-benchmarks: median of repeated batches, after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeat: int = 7, inner: int = 20) -> float:
    """Milliseconds per call of `fn`: the median over `repeat` batches of `inner` calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(samples)
