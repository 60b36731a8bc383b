"""The router's settings: one frozen dataclass, the single home of its defaults and checks,
and the parsers for the `--replica URL#k=v` / `--replica-dns NAME:PORT#k=v` values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from fornax.config import ConfigError

DEFAULT_POLICY = "cache-aware"


@dataclass(frozen=True)
class ReplicaSpec:
    """A replica named on the command line: its base URL and its tags (e.g. {"tag": "long"})."""

    url: str
    tags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DnsSpec:
    """`--replica-dns NAME:PORT`: every address NAME resolves to is a replica on PORT."""

    name: str
    port: int
    tags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[ReplicaSpec, ...] = ()
    replica_dns: tuple[DnsSpec, ...] = ()
    policy: str = DEFAULT_POLICY
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[tuple[str, str], ...] = ()  # (name, key): clients of the router
    admin_keys: tuple[tuple[str, str], ...] = ()  # may use /router/replicas (and everything else)
    replica_api_key: str | None = None  # sent to replicas; None: the client's Authorization passes
    # Sent only with the router's own polls (/health, /metrics, /v1/models), so replicas with
    # keys report load and models while each client's own key still reaches them (their
    # tenancy: usage, rate limits, cache scope per key). None: the replica API key, if any.
    replica_poll_key: str | None = None
    public_metrics: bool = False
    access_log: bool = True
    log_level: str = "info"
    # -- polling and health --
    poll_interval_s: float = 1.0  # /health, /metrics, /v1/models of every replica; DNS re-resolution
    poll_timeout_s: float = 2.0
    unhealthy_after: int = 3  # consecutive failed health checks that eject a replica
    healthy_after: int = 2  # consecutive good health checks that re-admit an ejected one
    # -- failover --
    max_attempts: int = 3  # replicas tried per request, the first included
    backoff_base_s: float = 0.05  # before attempt k (k >= 2): base * 2**(k-2), jittered, capped
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # longest silence from a replica (a long CPU prefill is slow)
    max_connections: int = 1024  # the shared pool's bound, all replicas together
    max_body_bytes: int = 4 << 20
    # -- cache-aware --
    cache_threshold: float = 0.5  # share of the prompt a replica's cached prefix must cover
    balance_abs_threshold: float = 32.0  # imbalance = both thresholds exceeded -> least-load
    balance_rel_threshold: float = 1.5
    cache_max_chars: int = 8 << 20  # the prefix tree's size cap (see radix.py for what is counted)
    # -- length --
    long_prompt_tokens: int = 1024  # estimated tokens above which a prompt goes to the long pool
    long_pool_tag: tuple[str, str] = ("tag", "long")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("poll_interval_s", "poll_timeout_s", "connect_timeout_s", "read_timeout_s"):
            _check_positive(name, getattr(self, name))
        for name in (
            "unhealthy_after",
            "healthy_after",
            "max_attempts",
            "max_connections",
            "max_body_bytes",
            "cache_max_chars",
            "long_prompt_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ConfigError("backoff needs 0 <= backoff_base_s <= backoff_max_s")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ConfigError("balance thresholds: absolute >= 0 and relative >= 1")
        for name in ("replica_api_key", "replica_poll_key"):
            key = getattr(self, name)
            if key == "" or (key is not None and not key.isprintable()):
                raise ConfigError(f"{name} must be a non-empty line of printable characters")

    @property
    def poll_key(self) -> str | None:
        """The key the router's own polls present to replicas."""
        return self.replica_poll_key if self.replica_poll_key is not None else self.replica_api_key


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value}")


def normalize_url(url: str) -> str:
    """'HTTP://Host:8000/' -> 'http://host:8000': the one spelling a replica is known by."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"a replica URL needs http:// or https:// and a host, got {url!r}")
    if parts.query or parts.fragment or parts.path.strip("/"):
        raise ConfigError(f"a replica URL is a base URL (no path, query or fragment), got {url!r}")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"bad port in replica URL {url!r}") from None
    return f"{parts.scheme.lower()}://{host}" + (f":{port}" if port is not None else "")


def parse_tags(text: str) -> tuple[tuple[str, str], ...]:
    """'tag=long,zone=a' -> (("tag", "long"), ("zone", "a"))."""
    tags: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"a replica tag is key=value, got {item!r}")
        tags.append((key.strip(), value.strip()))
    return tuple(tags)


def parse_replica(value: str) -> ReplicaSpec:
    """'http://h1:8000#tag=long' -> ReplicaSpec('http://h1:8000', (('tag', 'long'),))."""
    url, _, tags = value.partition("#")
    return ReplicaSpec(normalize_url(url), parse_tags(tags))


def parse_dns(value: str) -> DnsSpec:
    """'replicas.default.svc:8000#tag=long' -> DnsSpec; the port is required."""
    target, _, tags = value.partition("#")
    name, sep, port = target.strip().rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--replica-dns is NAME:PORT, got {value!r}")
    return DnsSpec(name.strip("[]"), int(port), parse_tags(tags))


def parse_tag_pair(value: str) -> tuple[str, str]:
    """'tag=long' -> ('tag', 'long')."""
    tags = parse_tags(value)
    if len(tags) != 1:
        raise ConfigError(f"expected one key=value, got {value!r}")
    return tags[0]
