"""The router's own Prometheus metrics, `fornax_router:<name>`, in a private registry (so
several routers, or a router and a server, can live in one process).

Replica labels are bounded by the replica set; a removed replica's gauges are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fornax.router.replicas import Replica

CONTENT_TYPE = CONTENT_TYPE_LATEST
NO_REPLICA = "none"  # the replica label of a request no replica was found for
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "fornax_router:"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by the replica that answered (the last tried) and outcome.",
            ["replica", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries", "Attempts moved to another replica, by why.", ["reason"], registry=r
        )
        self.ejections = Counter(
            p + "ejections",
            "Replicas taken out of rotation, by replica and how "
            "(passive: a failed request; active: failed health checks).",
            ["replica", "kind"],
            registry=r,
        )
        self.decisions = Counter(
            p + "routing_decisions",
            "Routing decisions, by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.match_ratio = Histogram(
            p + "cache_match_ratio",
            "Cache-aware: share of the prompt found in the best candidate's recorded prefixes.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            p + "e2e_request_latency_seconds",
            "From the request's arrival to the end of its answer (the last streamed byte).",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.healthy = Gauge(p + "healthy_replicas", "Replicas in rotation.", registry=r)
        self.replicas = Gauge(p + "replicas", "Replicas in the set (in rotation or not).", registry=r)
        self.inflight = Gauge(
            p + "replica_inflight",
            "This router's requests in progress on a replica.",
            ["replica"],
            registry=r,
        )
        self.load = Gauge(
            p + "replica_load",
            "A replica's load as the router sees it (see fornax.router).",
            ["replica"],
            registry=r,
        )
        self._labelled: set[str] = set()

    def refresh(self, replicas: Iterable[Replica]) -> None:
        """Gauges from the replica set, at scrape time."""
        members = list(replicas)
        self.replicas.set(len(members))
        self.healthy.set(sum(1 for r in members if r.available))
        current = {r.url for r in members}
        for url in self._labelled - current:
            self.inflight.remove(url)
            self.load.remove(url)
        for replica in members:
            self.inflight.labels(replica.url).set(replica.inflight)
            self.load.labels(replica.url).set(replica.load)
        self._labelled = current

    def render(self, replicas: Iterable[Replica]) -> bytes:
        self.refresh(replicas)
        return generate_latest(self.registry)
