"""Health state machine, backoff bounds, /metrics parsing, DNS discovery, membership and
the router's settings."""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fornax.config import ConfigError
from fornax.router.cli import router_config
from fornax.router.config import DnsSpec, RouterConfig, normalize_url, parse_dns, parse_replica
from fornax.router.discovery import DnsDiscovery, address_url, resolve
from fornax.router.poller import parse_load
from fornax.router.proxy import backoff_delay, outcome_of, upstream_headers
from fornax.router.replicas import Health, ReplicaSet
from tests.support import free_port


def test_health_active_checks() -> None:
    h = Health(unhealthy_after=3, healthy_after=2)
    assert not h.healthy
    assert h.check_ok() and h.healthy  # a new replica enters on its first good check
    assert not h.check_failed() and not h.check_failed() and h.healthy
    assert h.check_failed() and not h.healthy and h.ejections == 1  # the third in a row
    assert not h.check_failed() and h.ejections == 1  # already out: counted once
    assert not h.check_ok() and not h.healthy  # one good check is not enough to come back
    assert h.check_ok() and h.healthy  # the second is


def test_health_counts_consecutive_only() -> None:
    h = Health(3, 2)
    h.check_ok()
    h.check_failed(), h.check_failed()
    h.check_ok()  # resets the failures
    h.check_failed(), h.check_failed()
    assert h.healthy
    h.eject()
    h.check_ok()
    h.check_failed()  # resets the successes
    assert not h.check_ok() and not h.healthy
    assert h.check_ok() and h.healthy


def test_passive_ejection() -> None:
    h = Health(3, 2)
    h.check_ok()
    assert h.eject() and not h.healthy and h.ejections == 1
    assert not h.eject() and h.ejections == 1
    h.check_ok()
    assert not h.healthy
    h.check_ok()
    assert h.healthy


def test_never_admitted_replica_enters_on_first_good_check() -> None:
    h = Health(3, 2)
    for _ in range(5):
        assert not h.check_failed()
    assert h.ejections == 0 and h.check_ok() and h.healthy


def test_outcomes_and_4xx() -> None:
    # The client's errors are outcomes, never faults (the stub tests check the replica stays in).
    assert [outcome_of(s) for s in (200, 400, 404, 429, 500, 503)] == [
        "ok",
        "client_error",
        "client_error",
        "rate_limited",
        "error",
        "unavailable",
    ]


def test_backoff_bounds() -> None:
    rng = random.Random(1)
    for retry in range(1, 8):
        ceiling = min(1.0, 0.05 * 2 ** (retry - 1))
        samples = [backoff_delay(retry, 0.05, 1.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples)
        assert max(samples) - min(samples) > ceiling / 4  # jittered, not constant
    assert backoff_delay(1, 0.0, 1.0) == 0.0


def test_parse_load_from_prometheus_client_text() -> None:
    registry = CollectorRegistry()
    running = Gauge("fornax:num_requests_running", "r", ["model_name"], registry=registry)
    running.labels("m1").set(3)
    running.labels("m2").set(2)  # summed over label sets
    Gauge("fornax:num_requests_waiting", "w", ["model_name"], registry=registry).labels("m1").set(7)
    Gauge("fornax:kv_cache_usage_perc", "kv", ["model_name"], registry=registry).labels("m1").set(0.5)
    Histogram("fornax:e2e_request_latency_seconds", "h", ["model_name"], registry=registry).labels(
        "m1"
    ).observe(1)
    Counter("fornax:num_requests_running_total_decoy", "d", registry=registry).inc(100)  # prefix-alike
    text = generate_latest(registry).decode()
    assert parse_load(text) == (5.0, 7.0, 0.5)
    assert parse_load("") == (0.0, 0.0, 0.0)


def test_replica_specs() -> None:
    assert parse_replica("HTTP://Host:8000/#tag=long,zone=a").url == "http://host:8000"
    assert parse_replica("http://h:1#tag=long").tags == (("tag", "long"),)
    assert normalize_url("http://[::1]:80") == "http://[::1]:80"
    assert parse_dns("svc.ns:8000#tag=long") == DnsSpec("svc.ns", 8000, (("tag", "long"),))
    for bad in ("h1:8000", "ftp://h", "http://h:8000/v1", "http://h#tag"):
        with pytest.raises(ConfigError):
            parse_replica(bad)
    with pytest.raises(ConfigError):
        parse_dns("no-port")
    with pytest.raises(ConfigError):
        RouterConfig(cache_threshold=1.5)
    with pytest.raises(ConfigError):
        RouterConfig(balance_rel_threshold=0.5)


def test_cli_flags_build_the_config() -> None:
    import argparse

    from fornax.router.cli import add_router_parser

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "router",
            "--replica",
            "http://a:1",
            "--replica",
            "http://b:2#tag=long",
            "--policy",
            "length",
            "--cache-max-chars",
            "1M",
            "--api-key",
            "k1",
        ]
    )
    config = router_config(args)
    assert [r.url for r in config.replicas] == ["http://a:1", "http://b:2"]
    assert config.policy == "length" and config.cache_max_chars == 1 << 20
    assert config.api_keys == (("key-1", "k1"),) and config.long_pool_tag == ("tag", "long")
    assert router_config(parser.parse_args(["router"])).replicas == ()  # an orchestrator adds them later


def test_upstream_headers() -> None:
    client = {
        "Authorization": "Bearer user",
        "Content-Type": "application/json",
        "Connection": "keep-alive",
        "Host": "router",
        "Accept-Encoding": "gzip",
        "X-Request-Id": "r1",
    }
    assert upstream_headers(client, None) == {
        "Authorization": "Bearer user",
        "Content-Type": "application/json",
        "X-Request-Id": "r1",
    }
    assert upstream_headers(client, "rk")["authorization"] == "Bearer rk"
    assert "Authorization" not in upstream_headers(client, "rk")


def test_dns_resolve_localhost() -> None:
    port = free_port()
    urls = asyncio.run(resolve("localhost", port))
    assert f"http://127.0.0.1:{port}" in urls
    assert all(u.endswith(f":{port}") for u in urls)
    assert address_url("::1", 80) == "http://[::1]:80"


def test_dns_discovery_adds_and_drains() -> None:
    answers: list[set[str] | Exception] = [
        {"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
        {"http://10.0.0.1:8000", "http://10.0.0.3:8000"},
        socket.gaierror("temporary failure"),  # a failed lookup changes nothing
        set(),
    ]

    async def resolver(name: str, port: int) -> set[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    replicas = ReplicaSet()
    replicas.add("http://10.0.0.9:8000", source="static")
    replicas.add("http://10.0.0.1:8000", source="static")  # also given by --replica: DNS never removes it
    events: list[tuple[str, str]] = []
    replicas.subscribe(lambda event, r: events.append((event, r.url)))
    dns = DnsDiscovery((DnsSpec("svc", 8000, (("tag", "long"),)),), replicas, resolver)
    asyncio.run(dns.sync())
    assert sorted(replicas.urls()) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.9:8000"]
    assert replicas.get("http://10.0.0.2:8000").tags == {"tag": "long"}
    asyncio.run(dns.sync())
    assert sorted(replicas.urls()) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.9:8000"]
    asyncio.run(dns.sync())
    assert len(replicas) == 3
    asyncio.run(dns.sync())
    assert sorted(replicas.urls()) == ["http://10.0.0.1:8000", "http://10.0.0.9:8000"]
    assert events == [
        ("add", "http://10.0.0.2:8000"),
        ("add", "http://10.0.0.3:8000"),
        ("remove", "http://10.0.0.2:8000"),
        ("remove", "http://10.0.0.3:8000"),
    ]


def test_replica_set_membership_from_threads() -> None:
    replicas = ReplicaSet()
    urls = [f"http://10.1.0.{i}:8000" for i in range(50)]

    def add(chunk: list[str]) -> None:
        for url in chunk:
            replicas.add(url, {"pool": "a"})

    threads = [threading.Thread(target=add, args=(urls[i::5],)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(replicas.urls()) == sorted(urls)
    replica = replicas.get(urls[0])
    assert (
        replica is not None
        and replicas.add(urls[0], {"pool": "b"}) is replica
        and replica.tags == {"pool": "b"}
    )
    replica.begin_request()
    assert replicas.remove(urls[0]) and not replicas.remove(urls[0])
    assert replica.removed and not replica.available and replicas.draining() == [replica]
    replica.end_request(0)
    assert replicas.draining() == []
