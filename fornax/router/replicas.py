"""Replicas, their health, their load, and the set of them the router routes over.

`ReplicaSet` is the membership API for orchestrators (the CLI's --replica/--replica-dns, the
admin routes, and in-process callers such as a Ray deployment): add(url, tags=...),
remove(url), urls(). It may be called from any thread: membership is a dict replaced
whole under a lock (copy on write), so the event loop reads it without locking. A removed
replica is drained, not cut: requests already on it run to the end, new ones never see it.

A replica's per-request state (in-flight count, load, health) is touched only on the
router's event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fornax.router.config import normalize_url

# Why a replica left the rotation (the ejections metric's label).
EJECT_PASSIVE, EJECT_ACTIVE = "passive", "active"


@dataclass
class Health:
    """Active checks and passive ejection, as one state machine.

    - A replica starts out of rotation; its first good check admits it (it never failed).
    - `unhealthy_after` consecutive failed checks take a healthy replica out ("active").
    - A connection error or 5xx on a proxied request takes it out at once ("passive").
    - Once out after having been in, `healthy_after` consecutive good checks bring it back.
    A 4xx never reaches this class (the client's fault), nor does a 503 (not ready: the
    Replica's `ready` flag, which the next good check clears).
    """

    unhealthy_after: int = 3
    healthy_after: int = 2
    healthy: bool = False
    was_healthy: bool = False  # ever admitted: re-admission needs `healthy_after` good checks
    failures: int = 0  # consecutive failed checks
    successes: int = 0  # consecutive good checks
    ejections: int = 0

    def check_ok(self) -> bool:
        """A good health check; True when this admits the replica."""
        self.failures, self.successes = 0, self.successes + 1
        if self.healthy or (self.was_healthy and self.successes < self.healthy_after):
            return False
        self.healthy = self.was_healthy = True
        return True

    def check_failed(self) -> bool:
        """A failed health check (no answer, or a status other than 200/503); True when
        this takes the replica out."""
        self.successes, self.failures = 0, self.failures + 1
        if self.healthy and self.failures >= self.unhealthy_after:
            return self._out()
        return False

    def eject(self) -> bool:
        """A proxied request failed on this replica; True when it was in rotation."""
        self.successes = 0
        return self._out() if self.healthy else False

    def _out(self) -> bool:
        self.healthy = False
        self.ejections += 1
        return True


@dataclass
class Replica:
    """One replica. Load (see fornax/router/__init__.py) is

        polled running + polled waiting + requests sent since the last /metrics scrape
        was taken and not finished yet

    The last term is exact: each request remembers the poll epoch it was sent in, and a
    scrape sent in epoch E reflects every request sent before E.
    """

    url: str
    tags: dict[str, str] = field(default_factory=dict)
    source: str = "api"  # "static", "api", or "dns:NAME:PORT" (DNS removes only its own)
    health: Health = field(default_factory=Health)
    ready: bool = True  # False after a 503 (loading, draining) until a good health check
    removed: bool = False
    inflight: int = 0  # this router's requests on the replica (attempts in progress)
    running: float = 0.0  # polled fornax:num_requests_running
    waiting: float = 0.0  # polled fornax:num_requests_waiting
    kv_usage: float = 0.0  # polled fornax:kv_cache_usage_perc (0..1)
    models: frozenset[str] | None = None  # from /v1/models; None: not known yet (serves any)
    model_cards: tuple[dict[str, Any], ...] = ()
    last_error: str | None = None
    _epoch: int = 0
    _unreflected: dict[int, int] = field(default_factory=dict)  # epoch -> requests still running

    @property
    def available(self) -> bool:
        return self.health.healthy and self.ready and not self.removed

    @property
    def unreflected(self) -> int:
        return sum(self._unreflected.values())

    @property
    def load(self) -> float:
        return self.running + self.waiting + self.unreflected

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def tagged(self, key: str, value: str) -> bool:
        return self.tags.get(key) == value

    def begin_request(self) -> int:
        """A request is sent: the epoch to hand back to `end_request`."""
        self.inflight += 1
        epoch = self._epoch
        self._unreflected[epoch] = self._unreflected.get(epoch, 0) + 1
        return epoch

    def end_request(self, epoch: int) -> None:
        self.inflight -= 1
        left = self._unreflected.get(epoch)
        if left is not None:  # else a scrape already counted it in running/waiting
            if left <= 1:
                del self._unreflected[epoch]
            else:
                self._unreflected[epoch] = left - 1

    def begin_scrape(self) -> int:
        """A /metrics scrape is sent: requests from now on are in a new epoch."""
        self._epoch += 1
        return self._epoch

    def apply_scrape(self, mark: int, running: float, waiting: float, kv_usage: float) -> None:
        """The scrape sent at `mark` answered: everything sent before it is in its numbers."""
        self.running, self.waiting, self.kv_usage = running, waiting, kv_usage
        for epoch in [e for e in self._unreflected if e < mark]:
            del self._unreflected[epoch]

    def describe(self) -> dict[str, Any]:
        """The admin view (GET /router/replicas)."""
        return {
            "url": self.url,
            "tags": dict(self.tags),
            "source": self.source,
            "healthy": self.health.healthy,
            "ready": self.ready,
            "draining": self.removed,
            "inflight": self.inflight,
            "load": self.load,
            "polled": {"running": self.running, "waiting": self.waiting, "kv_cache_usage": self.kv_usage},
            "models": None if self.models is None else sorted(self.models),
            "ejections": self.health.ejections,
            "consecutive_failures": self.health.failures,
            "last_error": self.last_error,
        }


Listener = Callable[[str, Replica], None]  # ("add" | "remove", replica), in the caller's thread


class ReplicaSet:
    def __init__(self, unhealthy_after: int = 3, healthy_after: int = 2) -> None:
        self._thresholds = (unhealthy_after, healthy_after)
        self._members: dict[str, Replica] = {}
        self._draining: dict[int, Replica] = {}  # removed with requests still running
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def add(self, url: str, tags: dict[str, str] | None = None, source: str = "api") -> Replica:
        """Add a replica (or retag one already there); it enters rotation on its first good
        health check. Returns the Replica."""
        url = normalize_url(url)
        with self._lock:
            replica = self._members.get(url)
            if replica is not None:
                replica.tags = dict(tags) if tags is not None else replica.tags
                return replica
            health = Health(*self._thresholds)
            replica = Replica(url, dict(tags or {}), source, health)
            self._members = {**self._members, url: replica}
        self._notify("add", replica)
        return replica

    def remove(self, url: str) -> bool:
        """Take a replica out: no new requests; those on it finish. False if unknown."""
        url = normalize_url(url)
        with self._lock:
            replica = self._members.get(url)
            if replica is None:
                return False
            self._members = {u: r for u, r in self._members.items() if u != url}
            replica.removed = True
            self._draining[id(replica)] = replica
        self._notify("remove", replica)
        return True

    def urls(self) -> list[str]:
        return list(self._members)

    def get(self, url: str) -> Replica | None:
        return self._members.get(normalize_url(url))

    def members(self) -> tuple[Replica, ...]:
        return tuple(self._members.values())

    def __iter__(self) -> Iterator[Replica]:
        return iter(tuple(self._members.values()))

    def __len__(self) -> int:
        return len(self._members)

    def draining(self) -> list[Replica]:
        """Removed replicas that still have requests running (forgotten once they have none)."""
        with self._lock:
            for key in [k for k, r in self._draining.items() if r.inflight <= 0]:
                del self._draining[key]
            return list(self._draining.values())

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _notify(self, event: str, replica: Replica) -> None:
        for listener in list(self._listeners):
            listener(event, replica)
