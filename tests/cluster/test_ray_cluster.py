"""Replicas on a real local Ray runtime behind the real `fornax router` (slow).

One Ray runtime (2 CPUs) for the module; each test's controller drains its replicas and stops
its router at the end, and the module checks no `fornax serve` child outlives it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from fornax.cluster.config import ClusterConfig, ReplicaSpec, ScalingPolicy
from fornax.cluster.controller import READY, ClusterController
from fornax.cluster.process import free_port

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'fornax[cluster]')")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_turn"),
]  # one Ray runtime at a time (conftest.py)
MODEL = "smollm2-135m-instruct"
CHILD_PATTERN = "fornax.cluster.child"  # every replica server's command line


def _children() -> list[str]:
    r = subprocess.run(["pgrep", "-af", CHILD_PATTERN], check=False, capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if "pgrep" not in line]


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    before = set(_children())
    saved = os.environ.get("FORNAX_HOME")
    os.environ["FORNAX_HOME"] = saved or "/tmp/fhome"  # Ray's workers inherit it: the model cache
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("FORNAX_HOME", None)
        deadline = time.monotonic() + 15  # a killed actor's server drains, then exits
        while set(_children()) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(_children()) - before, "replica servers outlived the test"


@pytest.fixture
def make_cluster(ray_runtime: None) -> Iterator[Callable[..., ClusterController]]:
    made: list[ClusterController] = []

    def make(
        replicas: int,
        low: int,
        high: int,
        serve_args: tuple[str, ...] = (),
        policy: str = "cache-aware",
        **scaling: float,
    ) -> ClusterController:
        spec = ReplicaSpec(
            model=MODEL,
            serve_args=("--max-model-len", "256", "--no-access-log", *serve_args),
            num_threads=1,
            shutdown_timeout_s=20.0,
            ready_timeout_s=120.0,
        )
        config = ClusterConfig(
            replica=spec,
            scaling=ScalingPolicy(min_replicas=low, max_replicas=high, **scaling),
            replicas=replicas,
            router_port=free_port("127.0.0.1"),
            max_restarts=2,
            policy=policy,
            router_args=("--no-access-log",),
        )
        controller = ClusterController(config)
        made.append(controller)
        controller.start()
        return controller

    yield make
    for controller in made:
        try:
            controller.shutdown()
        except Exception as exc:
            print(f"shutdown failed: {exc}")


def complete(base_url: str, prompt: str = "Hello", max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        base_url + "/v1/completions",
        timeout=120,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def wait_until(
    check: Callable[[], bool],
    timeout_s: float,
    tick: Callable[[], None] | None = None,
    on_fail: Callable[[], object] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s}s: {on_fail()}")


def router_view(controller: ClusterController) -> dict[str, dict]:
    r = httpx.get(controller.router_url + "/router/replicas", timeout=10)
    r.raise_for_status()
    return {item["url"]: item for item in r.json()["data"]}


def test_a_killed_replica_is_restarted_and_served_through_the_router(make_cluster: Callable) -> None:
    controller = make_cluster(replicas=2, low=2, high=2)
    urls = set(controller.serving_urls())
    assert len(urls) == 2 and set(router_view(controller)) == urls
    assert complete(controller.router_url).status_code == 200

    victim = controller.replicas()["r0"]
    old_url = victim.url
    ray.kill(victim.actor, no_restart=False)  # as a crashed worker or a lost node: Ray restarts it
    for i in range(3):  # meanwhile the router fails over to the other replica
        r = complete(controller.router_url, prompt=f"While r0 is down {i}")
        assert r.status_code == 200 and r.headers["x-fornax-replica"] != old_url, r.text

    def restarted() -> bool:
        r0 = controller.replicas().get("r0")
        return r0 is not None and r0.state == READY and r0.url != old_url

    wait_until(restarted, 90, tick=controller.tick)
    new_url = controller.replicas()["r0"].url
    assert new_url is not None
    assert httpx.get(new_url + "/health", timeout=5).status_code == 200
    assert complete(new_url).status_code == 200
    assert not _answers(old_url)  # its server went with the old actor
    assert set(router_view(controller)) == {new_url, *(urls - {old_url})}  # swapped in the router

    # The router sends it requests once its own health check admits it.
    wait_until(lambda: router_view(controller)[new_url]["healthy"], 15)
    served = set()
    for i in range(12):
        r = complete(controller.router_url, prompt=f"Request {i}: tell me about rivers")
        assert r.status_code == 200, r.text
        served.add(r.headers["x-fornax-replica"])
        if new_url in served:
            break
    assert new_url in served, served


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


class Load:
    """Clients sending completions through the router in a loop, each keeping its statuses."""

    def __init__(self, base_url: str, clients: int, max_tokens: int) -> None:
        self.base_url, self.max_tokens = base_url, max_tokens
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.replicas: set[str] = set()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                r = complete(
                    self.base_url, prompt=f"Client {i}, request {n}: count to ten", max_tokens=self.max_tokens
                )
                self.statuses.append(r.status_code)
                self.replicas.add(r.headers.get("x-fornax-replica", "?"))
            except httpx.HTTPError as exc:
                self.statuses.append(-1)
                print(f"client {i}: {type(exc).__name__}: {exc}")
            n += 1

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def test_autoscale_up_under_load_and_down_when_idle_without_failures(make_cluster: Callable) -> None:
    # --max-num-seqs 1: one sequence runs, the rest wait, so a few clients make a queue.
    # least-load: cache-aware would keep these similar prompts on the replica that has their
    # prefix until the imbalance passes its threshold (32 requests), which 4 clients never reach.
    controller = make_cluster(
        replicas=1,
        low=1,
        high=2,
        serve_args=("--max-num-seqs", "1"),
        policy="least-load",
        target_waiting=1.0,
        scale_up_delay_s=1.0,
        scale_down_cooldown_s=3.0,
    )
    stop = threading.Event()
    loop = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    loop.start()
    heavy = light = None
    try:
        heavy = Load(controller.router_url, clients=4, max_tokens=16)  # ~3 waiting on one replica
        wait_until(lambda: len(controller.serving_urls()) == 2, 90, on_fail=lambda: controller.events)
        both = set(controller.serving_urls())
        wait_until(lambda: both <= heavy.replicas, 30, on_fail=lambda: (heavy.replicas, controller.events))
        light = Load(controller.router_url, clients=1, max_tokens=8)  # traffic through the scale-down
        heavy.end()
        wait_until(
            lambda: len(controller.replicas()) == 1, 60, on_fail=lambda: controller.events
        )  # drained, stopped
        time.sleep(1.0)
        light.end()
    finally:
        for load in (heavy, light):
            if load is not None:
                load.end()
        stop.set()
        loop.join(timeout=30)
    events = controller.events
    assert any(e.startswith("scale up") for e in events) and any(
        e.startswith("scale down") for e in events
    ), events
    statuses = heavy.statuses + light.statuses
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    print(f"{len(statuses)} requests, all 200; events: {events}")
