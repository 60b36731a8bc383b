"""Prometheus metrics for one served model: per-request latencies and token counts, per-step
batch sizes and inter-token gaps, engine gauges, and error counts by HTTP status.

Three feeds, each cheap and each in one place:

- `on_record(record)`: a finished request (metrics/records.py; the server's RequestRecord),
  once per finished request (event loop).
  Latency histograms (TTFT, E2E, queue, prefill, decode, time per output token), token
  counters and histograms, success by finish reason, aborts; for embedding, rerank and score
  requests (endpoint "embeddings") their own requests, prompt tokens and latency as well.
- `on_step(stats)`: the engine's StepStats, after every step (engine thread). Batch size
  histograms and the inter-token latency, from the time each sequence's tokens arrive.
- `refresh(snapshot)`: the engine's EngineStats (and KV tier stats) read at scrape time
  between two steps (event loop), so gauges are never stale when the engine idles, and the
  engine's cumulative totals (prefix cache queries/hits, preemptions) are mirrored into
  counters by their deltas.

Every metric is named `fornax:<name>` and labelled `model_name`. The registry is private to
the object, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import Metric as PromMetric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from fornax.engine.async_engine import StepStats
    from fornax.engine.core import EngineCore
    from fornax.engine.kv.offload.tiered import OffloadStats
    from fornax.engine.stats import EngineStats
    from fornax.metrics.records import FinishedRequest

CONTENT_TYPE = CONTENT_TYPE_LATEST
logger = logging.getLogger("fornax.metrics")

# Request-level times: a CPU prefill of a long prompt or a long generation takes minutes,
# a GPU TTFT a few milliseconds.
TIME_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# Per-token gaps: ~1 ms on a GPU decode, tens to hundreds of ms on a CPU or behind a prefill.
TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# The engine routes (server/api.py, openai_responses.py, anthropic_messages.py, embeddings.py), each
# a label of fornax:requests_total from the start, so rate() sees a route's first request.
ENDPOINTS = ("chat", "completions", "responses", "messages", "embeddings")
MODEL_LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.15,
    0.3,
    0.6,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Forget a sequence's last-token time after this long without output (safety net only:
# every sequence, aborted ones included, ends with a finished output that removes it).
_STALE_AFTER_S = 600.0


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_tokens` (which is always the last finite bucket)."""
    out: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            value = step * scale
            if value >= max_tokens:
                return tuple(float(v) for v in [*out, max_tokens])
            out.append(value)
        scale *= 10


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What one scrape reads of the engine, between two of its steps (see `snapshot_engine`)."""

    stats: EngineStats
    offload: OffloadStats | None = None  # KV tiers, when the engine has them


def snapshot_engine(core: EngineCore) -> EngineSnapshot:
    """Run in the engine thread (AsyncEngine.call), so the numbers agree with each other. The
    scrape is the one reader of the KV tiers' transfer times (EngineCore.take_offload_stats)."""
    return EngineSnapshot(core.stats(), core.take_offload_stats())


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        tok = token_buckets(max_model_len)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"fornax:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"fornax:{name}", doc, ["model_name"], registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"fornax:{name}", doc, ["model_name"], registry=self.registry).labels(model_name)

        t, gap = TIME_BUCKETS, TOKEN_GAP_BUCKETS
        # -- per request (from a FinishedRequest) --
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", t)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.", t)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling.", t)
        self.prefill = hist("request_prefill_time_seconds", "Time spent in prefill.", t)
        self.decode = hist("request_decode_time_seconds", "Time from the first to the last token.", t)
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Mean decode time per output token after the first, per request.",
            gap,
        )
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", tok)
        self.req_generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", tok)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (cached included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self._success = Counter(
            "fornax:request_success",
            "Finished sequences (one per choice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length"):  # present from the start, so rate() sees the first one
            self._success.labels(model_name, reason)
        self.aborted = counter("requests_aborted", "Requests aborted: the client left or the server gave up.")
        self._requests = Counter(
            "fornax:requests",
            "Generation requests ended (finished or aborted), by API route.",
            ["model_name", "endpoint"],
            registry=self.registry,
        )
        for endpoint in ENDPOINTS:
            self._requests.labels(model_name, endpoint)
        # -- embedding, rerank and score requests (server/embeddings.py: endpoint "embeddings"),
        # apart from generation's, since their latency is one prefill and no decode --
        self.embedding_requests = counter("embedding_requests", "Embedding, rerank and score requests ended.")
        self.embedding_prompt_tokens = counter(
            "embedding_prompt_tokens", "Prompt tokens of embedding, rerank and score requests."
        )
        self.embedding_latency = hist(
            "embedding_request_latency_seconds",
            "Engine time from arrival to the last input's result, per embedding, rerank or score request.",
            t,
        )
        self._errors = Counter(
            "fornax:request_errors",
            "HTTP responses with a 4xx or 5xx status, by status.",
            ["model_name", "status"],
            registry=self.registry,
        )
        # -- per step (from StepStats) --
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of one sequence.", gap)
        self.step_tokens = hist("engine_step_batched_tokens", "Tokens computed per engine step.", tok)
        self.step_seqs = hist(
            "engine_step_num_seqs", "Sequences scheduled per engine step.", token_buckets(1024)
        )
        self.step_seconds = hist(
            "engine_step_duration_seconds", "Wall time of one engine step.", STEP_SECONDS_BUCKETS
        )
        # -- engine state (refreshed at scrape time) --
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted to free KV cache blocks.")
        self.spec_drafts = counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.spec_acceptance = hist(
            "spec_decode_acceptance_rate",
            "Per speculating request: accepted / proposed draft tokens.",
            tuple(i / 10 for i in range(1, 11)),
        )
        # -- the model itself (server/model_set.py: loaded at start-up, or on demand with LRU unloading) --
        self.model_loaded = gauge("model_loaded", "1 while the model is loaded, else 0.")
        self.model_loads = counter("model_loads", "Times the model was loaded.")
        self.model_unloads = counter(
            "model_unloads", "Times the model was unloaded to make room for another."
        )
        self.model_load_seconds = hist("model_load_seconds", "Time to load the model.", MODEL_LOAD_BUCKETS)

        # -- LoRA adapters (docs/lora.md): series per adapter, made as adapters appear --
        def per_adapter(name: str, doc: str) -> Counter:
            return Counter(f"fornax:{name}", doc, ["model_name", "adapter"], registry=self.registry)

        self._lora_requests = per_adapter("lora_requests", "Requests ended that ran with a LoRA adapter.")
        self._lora_prompt_tokens = per_adapter(
            "lora_prompt_tokens", "Prompt tokens of requests with an adapter."
        )
        self._lora_generation_tokens = per_adapter(
            "lora_generation_tokens", "Tokens generated for requests with an adapter."
        )
        self._lora_loads = per_adapter(
            "lora_adapter_loads", "Times an adapter was loaded (at start or run time)."
        )
        self._lora_unloads = per_adapter("lora_adapter_unloads", "Times an adapter was unloaded.")
        self._mirrored = {"queries": 0, "hits": 0, "preemptions": 0, "drafts": 0, "accepted": 0}
        self._init_offload(model_name)
        # Last token time per (engine request id, choice index): touched by the engine thread only.
        self._last_token: dict[tuple[str, int], float] = {}
        self._last_prune = time.time()  # StepStats.time is wall-clock time

    def _init_offload(self, model_name: str) -> None:
        """KV tiers (engine/kv/offload): zero unless the engine has them."""
        reg = self.registry

        def labelled(kind: type, name: str, doc: str, label: str, values: tuple[str, ...], **kw: Any) -> Any:
            metric = kind(f"fornax:{name}", doc, ["model_name", label], registry=reg, **kw)
            return {v: metric.labels(model_name, v) for v in values}

        self.offload_hits = labelled(
            Counter,
            "kv_offload_hit_tokens",
            "Prompt tokens loaded from a KV tier instead of recomputed, by tier.",
            "tier",
            ("host", "disk"),
        )
        self.offload_bytes = labelled(
            Counter,
            "kv_offload_bytes",
            "Bytes of KV moved between tiers, by direction.",
            "direction",
            ("to_host", "from_host", "to_disk", "from_disk"),
        )
        self.offload_seconds = labelled(
            Histogram,
            "kv_offload_transfer_seconds",
            "Time of one step's KV copies: save (to host), load (to the primary "
            "pool), disk_read (reading and verifying chunks).",
            "kind",
            ("save", "load", "disk_read"),
            buckets=STEP_SECONDS_BUCKETS,
        )
        self.offload_usage = labelled(
            Gauge, "kv_offload_usage_perc", "Fraction of a KV tier in use (0..1).", "tier", ("host", "disk")
        )
        self.offload_swaps = labelled(
            Counter,
            "kv_offload_swaps",
            "Preempted requests swapped out / back in.",
            "direction",
            ("out", "in"),
        )
        self.offload_corrupt = Counter(
            "fornax:kv_offload_corrupt_chunks",
            "Disk chunks that failed their checks and were recomputed.",
            ["model_name"],
            registry=reg,
        ).labels(model_name)
        self._offload_mirrored: dict[str, int] = {}

    def _refresh_offload(self, o: OffloadStats) -> None:
        totals = {
            ("hits", "host"): o.hit_tokens_host,
            ("hits", "disk"): o.hit_tokens_disk,
            ("bytes", "to_host"): o.bytes_to_host,
            ("bytes", "from_host"): o.bytes_from_host,
            ("bytes", "to_disk"): o.bytes_to_disk,
            ("bytes", "from_disk"): o.bytes_from_disk,
            ("swaps", "out"): o.swapped_out,
            ("swaps", "in"): o.swapped_in,
            ("corrupt", ""): o.corrupt_chunks,
        }
        for (kind, label), total in totals.items():
            key = f"{kind}:{label}"
            delta = total - self._offload_mirrored.get(key, 0)
            if delta > 0:
                target = {
                    "hits": self.offload_hits,
                    "bytes": self.offload_bytes,
                    "swaps": self.offload_swaps,
                }.get(kind)
                (target[label] if target is not None else self.offload_corrupt).inc(delta)
                self._offload_mirrored[key] = total
        for kind, seconds in o.transfer_times:
            self.offload_seconds[kind].observe(seconds)
        self.offload_usage["host"].set(
            o.host_blocks_used / o.host_blocks_total if o.host_blocks_total else 0.0
        )
        self.offload_usage["disk"].set(o.disk_bytes_used / o.disk_bytes_total if o.disk_bytes_total else 0.0)

    # -- feeds --
    def on_record(self, record: FinishedRequest) -> None:
        self._requests.labels(self.model_name, record.endpoint).inc()
        if record.endpoint == "embeddings":
            self._on_embedding(record)
        if record.lora is not None:
            self._lora_requests.labels(self.model_name, record.lora).inc()
            self._lora_prompt_tokens.labels(self.model_name, record.lora).inc(record.num_prompt_tokens)
            self._lora_generation_tokens.labels(self.model_name, record.lora).inc(
                record.num_completion_tokens
            )
        self.prompt_tokens.inc(record.num_prompt_tokens)
        self.generation_tokens.inc(record.num_completion_tokens)
        self.req_prompt_tokens.observe(record.num_prompt_tokens)
        self.req_generation_tokens.observe(record.num_completion_tokens)
        if record.aborted:
            self.aborted.inc()
            return
        for reason in record.finish_reasons:
            self._success.labels(self.model_name, reason or "stop").inc()
        t = record.timings
        if not t:
            return
        if "spec_acceptance_rate" in t:
            self.spec_acceptance.observe(t["spec_acceptance_rate"])
        self.ttft.observe(t.get("ttft_s", 0.0))
        self.e2e.observe(t.get("e2e_s", 0.0))
        self.queue.observe(t.get("queue_s", 0.0))
        self.prefill.observe(t.get("prefill_s", 0.0))
        self.decode.observe(t.get("decode_s", 0.0))
        decode_tokens = record.num_completion_tokens - len(record.finish_reasons)  # first tokens excluded
        if decode_tokens > 0:
            self.tpot.observe(t.get("decode_s", 0.0) / decode_tokens)

    def _on_embedding(self, record: FinishedRequest) -> None:
        """Every ended embedding request counts (as fornax:requests does); the latency of the
        finished ones: e2e_s, the request's last input's (server/generation.py timings)."""
        self.embedding_requests.inc()
        self.embedding_prompt_tokens.inc(record.num_prompt_tokens)
        if not record.aborted and "e2e_s" in record.timings:
            self.embedding_latency.observe(record.timings["e2e_s"])

    def on_step(self, stats: StepStats) -> None:
        # Runs in the engine thread, where an exception would stop the engine: never raise.
        try:
            self._on_step(stats)
        except Exception:
            logger.exception("metrics step listener failed")

    def _on_step(self, stats: StepStats) -> None:
        if stats.num_seqs:
            self.step_tokens.observe(stats.num_batched_tokens)
            self.step_seqs.observe(stats.num_seqs)
            self.step_seconds.observe(stats.duration_s)
        now = stats.time
        last = self._last_token
        for out in stats.outputs:
            key = (out.request_id, out.index)
            n = len(out.new_token_ids)
            if n:
                prev = last.get(key)
                if prev is not None:
                    gap = (now - prev) / n  # several tokens in one step share the gap
                    for _ in range(n):
                        self.itl.observe(gap)
                last[key] = now
            if out.finished:
                last.pop(key, None)
        if now - self._last_prune > 60.0:
            self._last_prune = now
            for key in [k for k, t in last.items() if now - t > _STALE_AFTER_S]:
                del last[key]

    def refresh(self, snap: EngineSnapshot) -> None:
        """Gauges from the engine's state; counters grow by how much its totals grew."""
        stats = snap.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        mirrors = (
            ("queries", stats.prefix_cache_queries, self.prefix_queries),
            ("hits", stats.prefix_cache_hits, self.prefix_hits),
            ("preemptions", stats.num_preemptions_total, self.preemptions),
            ("drafts", stats.spec_num_draft_tokens_total, self.spec_drafts),
            ("accepted", stats.spec_num_accepted_tokens_total, self.spec_accepted),
        )
        for key, total, counter in mirrors:
            delta = total - self._mirrored[key]
            if delta > 0:
                counter.inc(delta)
            self._mirrored[key] = max(total, self._mirrored[key])
        if snap.offload is not None:
            self._refresh_offload(snap.offload)

    def on_model_loaded(self, seconds: float) -> None:
        self.model_loads.inc()
        self.model_load_seconds.observe(seconds)
        self.model_loaded.set(1)

    def on_model_unloaded(self) -> None:
        self.model_unloads.inc()
        self.model_loaded.set(0)

    def on_adapter(self, adapter: str, loaded: bool) -> None:
        """An adapter loaded (at start or through /v1/load_lora_adapter) or unloaded."""
        (self._lora_loads if loaded else self._lora_unloads).labels(self.model_name, adapter).inc()

    def on_response_status(self, status: int) -> None:
        if status >= 400:
            self._errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_all(metrics: list[Metrics]) -> bytes:
    """One exposition of several models' series: each family once, with every model's
    samples (each Metrics keeps its own registry, labelled by its model_name)."""
    if len(metrics) == 1:
        return metrics[0].render()
    families: dict[str, Any] = {}
    for m in metrics:
        for family in m.registry.collect():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = PromMetric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(family.samples)
    return generate_latest(_Families(list(families.values())))


class _Families:
    """A collector-registry stand-in that yields given metric families (for generate_latest)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)
