"""The controller: runs in the driver process, next to the router subprocess.

Once per poll interval (`tick`) it asks every replica actor for its status, hands the router
the URLs that changed (a restarted actor has a new one), finishes drains, and asks the
autoscaler for a step. It never blocks on one replica: each status call stays outstanding
across ticks until it answers, so a restarting actor delays only its own entry.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fornax.cluster.actor import ReplicaStatus, create_replica
from fornax.cluster.autoscaler import Autoscaler, Load, pick_victim
from fornax.cluster.config import ClusterConfig, ReplicaSpec
from fornax.cluster.membership import diff_membership
from fornax.cluster.router_client import Membership, RouterClient, RouterProcess
from fornax.config import env_fornax_home

logger = logging.getLogger("fornax.cluster")

STARTING, READY, DRAINING = "starting", "ready", "draining"
STATUS_WAIT_S = 0.5  # a tick waits this long for the status answers (they take milliseconds)


class ClusterError(RuntimeError):
    """The cluster could not start (a replica never became ready, the router did not start)."""


@dataclass
class Replica:
    """The controller's record of one replica; `rid` outlives the actor's restarts."""

    rid: str
    actor: Any
    started_at: float
    state: str = STARTING
    url: str | None = None  # the server's current URL, from its last status
    load: Load | None = None
    status_ref: Any = None  # the outstanding status() call
    drain_at: float | None = None  # when drain() is to be called (after the grace)
    drain_ref: Any = None

    @property
    def tags(self) -> dict[str, str]:
        return {"replica": self.rid, "source": "fornax-cluster"}


class ClusterController:
    def __init__(
        self,
        config: ClusterConfig,
        membership: Membership | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`membership`: None starts a `fornax router` and uses its admin routes; tests may
        pass a stand-in."""
        self.config = config
        self._membership = membership
        self._clock = clock
        self._autoscaler = Autoscaler(config.scaling, clock)
        self._replicas: dict[str, Replica] = {}  # start order: pick_victim prefers the newest
        self._managed: set[str] = set()  # URLs we added to the router
        self._router: RouterProcess | None = None
        self._router_client: RouterClient | None = None
        self._owns_ray = False
        self._next_id = 0
        self.router_admin_key = secrets.token_urlsafe(24)
        self.events: list[str] = []  # what the controller did, newest last (logs and tests)
        self._lock = threading.Lock()  # a tick against readers in other threads (tests, embedders)

    # -- lifecycle --
    def start(self) -> None:
        """Ray, the router, the first replicas; returns once all of them serve."""
        try:
            self._init_ray()
            for _ in range(self.config.replicas):  # they load while the router starts
                self._add_replica()
            if self._membership is None:
                self._start_router()
            self._wait_first_replicas()
            self.tick()
        except BaseException:
            self.shutdown()
            raise

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.poll_interval_s):
            try:
                self.tick()
            except Exception:
                logger.exception("cluster tick failed; retrying at the next one")

    def shutdown(self) -> None:
        """Drain every replica (their in-flight requests finish), stop the router, stop Ray if
        it was started here. Safe to call twice."""
        import ray

        try:
            if ray.is_initialized():
                self._drain_all()
        finally:  # a failed drain must not leave the router or Ray behind
            if self._router is not None:
                self._router.stop()
                self._router = None
            if self._router_client is not None:
                self._router_client.close()
                self._router_client = None
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()  # kills what is left; each server's watchdog ends it with its actor
                self._owns_ray = False

    # -- the loop --
    def tick(self) -> None:
        with self._lock:
            self._poll()
            self._advance_drains()
            self._reap_stuck_starts()
            self.sync_membership()
            self._autoscale()

    def replicas(self) -> dict[str, Replica]:
        with self._lock:
            return dict(self._replicas)

    def serving_urls(self) -> list[str]:
        with self._lock:
            return [r.url for r in self._replicas.values() if r.state == READY and r.url]

    @property
    def membership(self) -> Membership:
        assert self._membership is not None, "start() first"
        return self._membership

    @property
    def router_url(self) -> str | None:
        return None if self._router is None else self._router.url

    # -- Ray and the router --
    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():  # an embedding program (a test) owns the runtime
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False)
        self._owns_ray = True

    def _start_router(self) -> None:
        c = self.config
        key = self.router_admin_key if c.router_auth else None
        args = self.router_args(key)
        self._router = RouterProcess(c.router_host, c.router_port, args)
        self._router.start()
        self._router_client = RouterClient(self._router.url, key)
        try:
            self._router.wait_ready(self._router_client, c.router_ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise ClusterError(str(exc)) from exc
        self._membership = self._router_client

    def router_args(self, admin_key: str | None) -> list[str]:
        """The router's flags: the policy, the controller's own admin key for /router/*, and,
        for replicas with keys, the replica admin key the cluster generated as the router's
        poll key: it reads their /metrics and /v1/models with it, while each client's own key
        is still what the replicas see on its requests (their per-key usage, limits, cache)."""
        c = self.config
        args = ["--policy", c.policy]
        if admin_key:
            args += ["--admin-key", f"fornax-cluster:{admin_key}"]
        if c.replica.metrics_key:  # "=": a generated key may start with "-", which argparse reads as a flag
            args.append(f"--replica-poll-key={c.replica.metrics_key}")
        return [*args, *c.router_args]

    # -- replicas --
    def _add_replica(self) -> Replica:
        rid = f"r{self._next_id}"
        self._next_id += 1
        actor = create_replica(self._replica_spec(), self.config.max_restarts)
        replica = Replica(rid, actor, started_at=self._clock())
        self._replicas[rid] = replica
        self._event(f"start {rid}")
        return replica

    def _replica_spec(self) -> ReplicaSpec:
        import ray

        spec = self.config.replica
        home = env_fornax_home()
        if home and "FORNAX_HOME" not in dict(spec.env):  # the model cache the driver uses
            spec = replace(spec, env=(*spec.env, ("FORNAX_HOME", home)))
        if spec.num_threads is None:  # the cluster's cores shared by the most replicas it may run
            cpus = int(ray.cluster_resources().get("CPU", 1))
            spec = replace(spec, num_threads=max(1, cpus // self.config.scaling.max_replicas))
        return spec

    def _wait_first_replicas(self) -> None:
        import ray

        refs = {r.rid: r.actor.ready.remote() for r in self._replicas.values()}
        timeout = self.config.replica.ready_timeout_s + 30  # placement and the actor's own start
        try:
            urls = ray.get(list(refs.values()), timeout=timeout)
        except Exception as exc:
            raise ClusterError(f"replicas did not become ready: {type(exc).__name__}: {exc}") from exc
        for rid, url in zip(refs, urls):
            self._replicas[rid].url = url
            self._replicas[rid].state = READY

    def _poll(self) -> None:
        import ray

        live = [r for r in self._replicas.values() if r.state != DRAINING]
        for r in live:
            if r.status_ref is None:
                r.status_ref = r.actor.status.remote()
        refs = [r.status_ref for r in live]
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=STATUS_WAIT_S)
        done_set = set(done)
        for r in live:
            if r.status_ref in done_set:
                ref, r.status_ref = r.status_ref, None
                self._take_status(r, ref)

    def _take_status(self, r: Replica, ref: Any) -> None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            status: ReplicaStatus = ray.get(ref)
        except ActorDiedError as exc:  # restarts used up (or killed for good): it is gone
            self._event(f"lost {r.rid}: its actor died for good ({_first_line(exc)})")
            del self._replicas[r.rid]
            return
        except RayActorError:  # restarting (ActorUnavailableError): out of the router until back
            if r.state == READY:
                self._event(f"{r.rid} unavailable (restarting)")
                r.started_at = self._clock()
            r.state, r.load = STARTING, None
            return
        if status.url != r.url and r.url is not None:
            self._event(f"{r.rid} restarted: {r.url} -> {status.url}")
            r.state, r.started_at = STARTING, self._clock()
        r.url = status.url
        r.load = status.load
        if status.healthy and r.state == STARTING:
            r.state = READY
            self._event(f"{r.rid} ready at {r.url}")
        # A ready replica that stops answering /health stays a member: the router's own health
        # checks take it out of rotation, and its actor restarts it if its server dies.

    def _reap_stuck_starts(self) -> None:
        """A replica that Ray cannot place (no free CPUs) or whose server never gets ready:
        give up after the ready timeout, so the autoscaler is not held forever."""
        import ray

        limit = self.config.replica.ready_timeout_s + 30
        for r in list(self._replicas.values()):
            if r.state == STARTING and self._clock() - r.started_at > limit:
                self._event(f"gave up on {r.rid}: not ready after {limit:g}s")
                ray.kill(r.actor, no_restart=True)
                del self._replicas[r.rid]

    # -- draining --
    def _begin_drain(self, r: Replica) -> None:
        """Out of the router first (no new requests), then SIGTERM after the grace."""
        r.state = DRAINING
        if r.url and r.url in self._managed:
            self.membership.remove(r.url)
            self._managed.discard(r.url)
        r.drain_at = self._clock() + self.config.drain_grace_s
        self._event(f"drain {r.rid} ({r.url})")

    def _advance_drains(self) -> None:
        import ray

        for r in [r for r in self._replicas.values() if r.state == DRAINING]:
            if r.drain_ref is None and r.drain_at is not None and self._clock() >= r.drain_at:
                r.drain_ref = r.actor.drain.remote()
            if r.drain_ref is not None and ray.wait([r.drain_ref], timeout=0)[0]:
                code = _get_quietly(r.drain_ref)
                ray.kill(r.actor, no_restart=True)
                del self._replicas[r.rid]
                self._event(f"stopped {r.rid} (server exit {code})")

    def _drain_all(self) -> None:
        import ray

        refs = {r.rid: r.actor.drain.remote() for r in self._replicas.values() if r.drain_ref is None}
        refs |= {r.rid: r.drain_ref for r in self._replicas.values() if r.drain_ref is not None}
        timeout = self.config.replica.shutdown_timeout_s + 15
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        for r in self._replicas.values():
            ray.kill(r.actor, no_restart=True)
        self._replicas.clear()

    # -- membership and scaling --
    def sync_membership(self) -> None:
        desired = {r.url: r.tags for r in self._replicas.values() if r.state == READY and r.url}
        diff = diff_membership(desired, self.membership.members(), self._managed)
        for url in diff.remove:
            self.membership.remove(url)
            self._managed.discard(url)
            self._event(f"router: removed {url}")
        for url, tags in diff.add.items():
            self.membership.add(url, tags)
            self._managed.add(url)
            self._event(f"router: added {url} ({tags['replica']})")

    def _autoscale(self) -> None:
        live = [r for r in self._replicas.values() if r.state != DRAINING]
        ready = {r.rid: r.load for r in live if r.state == READY and r.load is not None}
        busy = any(r.state != READY for r in self._replicas.values())
        decision = self._autoscaler.decide(len(live), list(ready.values()), busy=busy)
        if decision.delta > 0:
            self._event(f"scale up: {decision.reason}")
            self._add_replica()
        elif decision.delta < 0 and ready:
            self._event(f"scale down: {decision.reason}")
            self._begin_drain(self._replicas[pick_victim(ready)])

    def _event(self, text: str) -> None:
        logger.info("%s", text)
        self.events.append(text)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _get_quietly(ref: Any) -> Any:
    import ray

    try:
        return ray.get(ref)
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"
