"""`Router`: everything one router holds (replica set, policy, HTTP clients, poller,
metrics), started and stopped by the app's lifespan. Embedders (a Ray deployment, tests)
can build one around their own ReplicaSet and change membership from any thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import aiohttp
import httpx

from fornax.router.config import RouterConfig
from fornax.router.metrics import RouterMetrics
from fornax.router.policies import make_policy
from fornax.router.poller import Poller
from fornax.router.proxy import Proxy
from fornax.router.replicas import Replica, ReplicaSet
from fornax.router.upstream import open_session

logger = logging.getLogger("fornax.router")
POLL_CONNECTIONS = 64


class Router:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet | None = None) -> None:
        self.config = config
        self.replicas = (
            replicas if replicas is not None else ReplicaSet(config.unhealthy_after, config.healthy_after)
        )
        for spec in config.replicas:
            self.replicas.add(spec.url, dict(spec.tags), source="static")
        self.policy = make_policy(config)
        self.metrics = RouterMetrics()
        key = config.poll_key
        self.poll_headers = {"authorization": f"Bearer {key}"} if key else {}
        self._proxy: Proxy | None = None
        self._poller: Poller | None = None
        self._session: aiohttp.ClientSession | None = None
        self._poll_client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.replicas.subscribe(self._on_membership)

    @property
    def proxy(self) -> Proxy:
        if self._proxy is None:
            raise RuntimeError("the router is not started")
        return self._proxy

    async def start(self) -> None:
        cfg = self.config
        # One aiohttp session for all relayed requests, its connections kept alive between
        # them (upstream.py); made here because it binds to the running loop.
        self._session = open_session(cfg)
        # Health checks get their own small pool, so a saturated relay session cannot make
        # every replica look dead. trust_env=False: an HTTP(S)_PROXY meant for the outside
        # world must not sit between the router and its replicas.
        poll_client = httpx.AsyncClient(
            timeout=cfg.poll_timeout_s, trust_env=False, limits=httpx.Limits(max_connections=POLL_CONNECTIONS)
        )
        self._poll_client = poll_client
        self._proxy = Proxy(cfg, self.replicas, self.policy, self._session, self.metrics)
        self._poller = Poller(cfg, self.replicas, poll_client, self.metrics, self.poll_headers)
        self._loop = asyncio.get_running_loop()
        await self._poller.round()  # replicas already up are in rotation before the first request
        self._spawn(self._poller.run())
        logger.info(
            "routing over %d replica(s) with the %s policy: %s",
            len(self.replicas),
            self.policy.name,
            ", ".join(self.replicas.urls()) or "(none yet)",
        )

    async def stop(self) -> None:
        self._loop = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._poll_client is not None:
            await self._poll_client.aclose()

    async def check(self, replica: Replica) -> None:
        """One health check (and scrape) of `replica` now, or the wait for the one in progress."""
        if self._poller is not None:
            await self._poller.poll(replica)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_membership(self, event: str, replica: Replica) -> None:
        """A ReplicaSet listener: runs in whatever thread changed the set."""
        loop = self._loop
        if loop is None:  # not started: the first poll round covers additions
            if event == "remove":
                self.policy.forget(replica.url)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._membership_changed, event, replica)

    def _membership_changed(self, event: str, replica: Replica) -> None:
        if event == "add" and self._poller is not None:
            self._spawn(self._poller.poll(replica))  # in rotation at once if it is up
        elif event == "remove":
            self.policy.forget(replica.url)
