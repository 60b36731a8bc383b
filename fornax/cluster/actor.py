"""The Ray actor that owns one replica: a `fornax serve` subprocess on a free port.

The class is plain Python; `create_replica` wraps it with ray.remote when the controller
creates one, so importing this module never needs Ray. Each actor asks Ray for `num_threads`
CPUs and gives the server as many compute threads, so Ray's placement is also the cores'.

Lifetimes are tied both ways: the server exits when the actor dies (fornax.cluster.child), and
the actor exits (os._exit, which Ray counts as a crash) when its server dies on its own, so
Ray restarts it with a fresh server on a new port; up to max_restarts times.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from fornax.cluster.autoscaler import Load
from fornax.cluster.config import ReplicaSpec
from fornax.cluster.process import ReplicaProcess

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    url: str
    healthy: bool  # /health answered 200
    load: Load | None  # None until healthy, or when /metrics did not answer
    pid: int | None  # the server's


class ReplicaActor:
    def __init__(self, spec: ReplicaSpec) -> None:
        host = spec.host or _node_ip()
        self._spec = spec
        self._server = ReplicaProcess(spec, host)
        self._draining = False
        self._server.start()
        threading.Thread(target=self._exit_with_server, name="server-watch", daemon=True).start()

    def _exit_with_server(self) -> None:
        assert self._server.proc is not None
        code = self._server.proc.wait()
        if not self._draining:
            # A server that dies on its own (engine failure: exit 1) is replaced by Ray, not
            # kept as a dead member: exiting uncleanly is what makes Ray restart the actor.
            logger.error(
                "fornax serve at %s exited with %s; exiting so Ray restarts this replica",
                self._server.url,
                code,
            )
            os._exit(1)

    def url(self) -> str:
        return self._server.url

    def ready(self, timeout_s: float | None = None) -> str:
        """Block until /health answers 200; the URL. Raises if the server exits or times out."""
        self._server.wait_ready(self._spec.ready_timeout_s if timeout_s is None else timeout_s)
        return self._server.url

    def status(self) -> ReplicaStatus:
        """Quick (no waiting for readiness): what the controller polls every second."""
        healthy = self._server.health() == 200
        load = None
        if healthy:
            try:
                load = self._server.load()
            except Exception:
                load = None
        return ReplicaStatus(self._server.url, healthy, load, self._server.pid)

    def load(self) -> Load:
        return self._server.load()

    def drain(self) -> int | None:
        """SIGTERM the server and wait for it to finish its requests and exit; its exit code."""
        self._draining = True  # before the signal: the watch thread must not take it for a crash
        return self._server.drain()

    def pid(self) -> int | None:
        return self._server.pid


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


@functools.cache
def _remote_class() -> Any:
    import ray

    return ray.remote(ReplicaActor)


def create_replica(spec: ReplicaSpec, max_restarts: int, name: str | None = None) -> Any:
    """A ReplicaActor handle. Ray restarts it up to `max_restarts` times (-1: always); calls are
    not retried (max_task_retries 0): a status poll that meets a restart just fails, and the
    next one reaches the new actor."""
    options: dict[str, Any] = {"num_cpus": spec.num_threads, "max_restarts": max_restarts}
    if name is not None:
        options["name"] = name
    return _remote_class().options(**options).remote(spec)
