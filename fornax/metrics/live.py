"""A rolling window of per-second server stats for the live panel of the visualizer.

Fed by the engine's StepStats (engine thread, after every step) and by finished requests
(metrics/records.py; the server's RequestRecord) in the event loop, read by the
/v1/fornax/live stream (event loop); one lock guards it.
Prometheus keeps histograms since start; a live chart wants "the last few minutes", so this
keeps one small bucket per second for `window_s` seconds and summarizes on read.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fornax.engine.async_engine import StepStats
    from fornax.metrics.records import FinishedRequest


@dataclass
class _Bucket:
    second: int
    output_tokens: int = 0
    batched_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class LiveStats:
    def __init__(self, window_s: int = 300) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._buckets: deque[_Bucket] = deque()
        self._last_token: dict[tuple[str, int], float] = {}  # (request id, index) -> monotonic time

    def _bucket(self, now: float) -> _Bucket:
        second = int(now)
        if not self._buckets or self._buckets[-1].second != second:
            self._buckets.append(_Bucket(second))
            while self._buckets and self._buckets[0].second <= second - self.window_s:
                self._buckets.popleft()
        return self._buckets[-1]

    def on_step(self, stats: StepStats) -> None:
        """Engine thread: tokens, busy time, gauges, and inter-token gaps per sequence."""
        mono = time.monotonic()
        with self._lock:
            b = self._bucket(stats.time)
            b.steps += 1
            b.busy_s += stats.duration_s
            b.batched_tokens += stats.num_batched_tokens
            b.num_running, b.num_waiting = stats.num_running, stats.num_waiting
            b.kv_cache_usage = stats.kv_cache_usage
            for out in stats.outputs:
                if not out.new_token_ids:
                    continue
                b.output_tokens += len(out.new_token_ids)
                key = (out.request_id, out.index)
                last = self._last_token.get(key)
                if last is not None:
                    b.itl_s.append(mono - last)
                if out.finished:
                    self._last_token.pop(key, None)
                else:
                    self._last_token[key] = mono

    def on_record(self, record: FinishedRequest) -> None:
        """Event loop: one finished request's TTFT (aborted ones before their first token have none)."""
        ttft = record.timings.get("ttft_s")
        if ttft is None or record.num_completion_tokens == 0:
            return
        with self._lock:
            self._bucket(time.time()).ttft_s.append(ttft)
            # A sequence that ended without a finished output (never happens today) must not leak.
            if len(self._last_token) > 10_000:
                self._last_token.clear()

    def summary(self, bucket_s: int = 5) -> dict[str, Any]:
        """Series of `bucket_s`-second points over the window, plus the last 10 s as headline numbers."""
        now = time.time()
        with self._lock:
            buckets = list(self._buckets)
        start = int(now) - self.window_s + 1
        series: dict[int, list[_Bucket]] = {}
        for b in buckets:
            if b.second >= start:
                series.setdefault((b.second - start) // bucket_s, []).append(b)
        points = []
        for slot in sorted(series):
            group = series[slot]
            seconds = bucket_s
            last = group[-1]
            points.append(
                {
                    "t": start + slot * bucket_s + bucket_s,
                    "tokens_per_s": sum(b.output_tokens for b in group) / seconds,
                    "ttft_ms": _p50([x for b in group for x in b.ttft_s], 1000.0),
                    "itl_ms": _p50([x for b in group for x in b.itl_s], 1000.0),
                    "num_running": last.num_running,
                    "num_waiting": last.num_waiting,
                    "kv_cache_usage": last.kv_cache_usage,
                }
            )
        recent = [b for b in buckets if b.second > int(now) - 10]
        return {
            "window_s": self.window_s,
            "bucket_s": bucket_s,
            "series": points,
            "tokens_per_s_10s": sum(b.output_tokens for b in recent) / 10.0,
            "busy_10s": min(1.0, sum(b.busy_s for b in recent) / 10.0),
            "ttft_ms_p50": _p50([x for b in buckets for x in b.ttft_s], 1000.0),
            "itl_ms_p50": _p50([x for b in buckets for x in b.itl_s], 1000.0),
        }


def _p50(values: list[float], scale: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = ordered[len(ordered) // 2]
    return None if math.isnan(mid) else mid * scale
