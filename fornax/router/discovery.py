"""`--replica-dns NAME:PORT`: replicas found by resolving a name (a Kubernetes headless
Service answers with one A/AAAA record per ready pod), re-resolved every poll interval.

Every address becomes http://ADDR:PORT (IPv6 in brackets); an address that disappears is
removed from the set (drained: requests on it finish, no new ones go there). A lookup that
fails (no answer, timeout, NXDOMAIN) changes nothing: a DNS hiccup is not a fleet going
away, and replicas that did go away fail their health checks anyway. Only replicas this
name added are removed by it; one also given with --replica stays.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from fornax.router.config import DnsSpec, normalize_url
from fornax.router.replicas import ReplicaSet

logger = logging.getLogger("fornax.router")
Resolver = Callable[[str, int], Awaitable[set[str]]]


def address_url(address: str, port: int) -> str:
    return normalize_url(f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}")


async def resolve(name: str, port: int) -> set[str]:
    """Every A/AAAA address of `name` as a replica URL on `port`."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {address_url(str(info[4][0]).split("%")[0], port) for info in infos}


def dns_source(spec: DnsSpec) -> str:
    return f"dns:{spec.name}:{spec.port}"


class DnsDiscovery:
    def __init__(
        self, specs: tuple[DnsSpec, ...], replicas: ReplicaSet, resolver: Resolver = resolve
    ) -> None:
        self.specs, self.replicas, self.resolver = specs, replicas, resolver

    async def sync(self) -> None:
        for spec in self.specs:
            try:
                urls = await self.resolver(spec.name, spec.port)
            except OSError as exc:  # socket.gaierror included
                logger.warning("resolving %s failed (%s): replicas unchanged", spec.name, exc)
                continue
            self._apply(spec, urls)

    def _apply(self, spec: DnsSpec, urls: set[str]) -> None:
        source = dns_source(spec)
        current = {r.url for r in self.replicas if r.source == source}
        for url in sorted(urls - current):
            if self.replicas.get(url) is None:
                logger.info("%s: new replica %s", spec.name, url)
                self.replicas.add(url, dict(spec.tags), source=source)
        for url in sorted(current - urls):
            logger.info("%s: replica %s is gone from DNS: draining it", spec.name, url)
            self.replicas.remove(url)
