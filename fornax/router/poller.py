"""Active checks: every poll interval each replica's /health, and for a replica that answers
200 its /metrics (load) and /v1/models (what it serves), all replicas concurrently; then
the DNS names are re-resolved.

Health check outcomes: 200 is good; 503 means not ready (loading, draining, engine gone):
skipped until a 200, but not a failure; anything else — no answer within --poll-timeout,
a connection error, another status — is a failure (see replicas.Health).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fornax.router.config import RouterConfig
from fornax.router.discovery import DnsDiscovery
from fornax.router.metrics import RouterMetrics
from fornax.router.replicas import EJECT_ACTIVE, Replica, ReplicaSet

logger = logging.getLogger("fornax.router")
RUNNING, WAITING, KV_USAGE = (
    "fornax:num_requests_running",
    "fornax:num_requests_waiting",
    "fornax:kv_cache_usage_perc",
)
_WATCHED = (RUNNING, WAITING, KV_USAGE)


def parse_load(text: str) -> tuple[float, float, float]:
    """(running, waiting, KV usage) from a replica's Prometheus text, each summed over its
    label sets (0 if absent). Only the lines of these three metrics are handed to the
    parser: a replica's full exposition is mostly histograms, and parsing all of it every
    second on the event loop would stall every request the router is relaying."""
    lines = [line for line in text.splitlines() if _watched(line)]
    values = dict.fromkeys(_WATCHED, 0.0)
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values[RUNNING], values[WAITING], values[KV_USAGE]


def _watched(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) > 2 and parts[1] in ("HELP", "TYPE") and parts[2] in _WATCHED
    return line.startswith(_WATCHED)


class Poller:
    def __init__(
        self,
        config: RouterConfig,
        replicas: ReplicaSet,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        headers: dict[str, str],
    ) -> None:
        self.config, self.replicas, self.client, self.metrics = config, replicas, client, metrics
        self.headers = headers  # the poll key, if any: a replica's /metrics and /v1/models may need it
        self.dns = DnsDiscovery(config.replica_dns, replicas)
        self._polling: dict[str, asyncio.Future[None]] = {}  # URL -> its poll in progress (never two)

    async def run(self) -> None:
        """Forever: one round, then sleep out the rest of the interval."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.round()
            except Exception:
                logger.exception("poll round failed")
            await asyncio.sleep(max(0.0, self.config.poll_interval_s - (loop.time() - started)))

    async def round(self) -> None:
        if self.dns.specs:
            await self.dns.sync()
        await asyncio.gather(*(self.poll(r) for r in self.replicas))

    async def poll(self, replica: Replica) -> None:
        """Check one replica; a caller arriving while its poll is in progress waits for that
        one (the admin API answers an added replica with its first check's outcome)."""
        url = replica.url
        running = self._polling.get(url)
        if running is None:
            running = asyncio.ensure_future(self._poll_once(replica))
            self._polling[url] = running
            running.add_done_callback(lambda _: self._polling.pop(url, None))
        await asyncio.shield(running)  # one waiter cancelled (a client gone) leaves the poll running

    async def _poll_once(self, replica: Replica) -> None:
        if await self._check_health(replica):
            await asyncio.gather(self._scrape(replica), self._read_models(replica))

    async def _check_health(self, replica: Replica) -> bool:
        """One health check; True when the replica answered 200."""
        try:
            resp = await self.client.get(
                replica.url + "/health", headers=self.headers, timeout=self.config.poll_timeout_s
            )
            status = resp.status_code
        except httpx.HTTPError as exc:
            return self._failed(replica, f"health check: {type(exc).__name__}: {exc}")
        if status == 503:
            replica.ready, replica.last_error = False, "not ready (/health answered 503)"
            return False
        if status != 200:
            return self._failed(replica, f"health check: /health answered {status}")
        replica.ready = True
        if replica.health.check_ok():
            logger.info("replica %s is in rotation", replica.url)
            replica.last_error = None
        return True

    def _failed(self, replica: Replica, why: str) -> bool:
        replica.last_error = why
        if replica.health.check_failed():
            self.metrics.ejections.labels(replica.url, EJECT_ACTIVE).inc()
            logger.warning(
                "replica %s is out of rotation after %d failed health checks (%s)",
                replica.url,
                replica.health.failures,
                why,
            )
        return False

    async def _scrape(self, replica: Replica) -> None:
        mark = replica.begin_scrape()
        text = await self._get(replica, "/metrics")
        if text is not None:
            try:
                replica.apply_scrape(mark, *parse_load(text))
            except ValueError as exc:  # not Prometheus text: keep what we had
                logger.debug("cannot parse %s/metrics: %s", replica.url, exc)

    async def _read_models(self, replica: Replica) -> None:
        text = await self._get(replica, "/v1/models")
        if text is None:
            return
        try:
            data: Any = json.loads(text).get("data")
            cards = tuple(c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str))
        except (ValueError, AttributeError, TypeError):
            return
        replica.models = frozenset(c["id"] for c in cards)
        replica.model_cards = cards

    async def _get(self, replica: Replica, path: str) -> str | None:
        """The body of a 200 answer, or None (a replica that hides /metrics behind a key the
        router lacks still serves: its load is then this router's in-flight count)."""
        try:
            resp = await self.client.get(
                replica.url + path, headers=self.headers, timeout=self.config.poll_timeout_s
            )
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None
