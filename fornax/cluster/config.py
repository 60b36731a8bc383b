"""The cluster's settings and defaults: one frozen dataclass per concern.

`ScalingPolicy` is all the autoscaler reads (so its tests build one directly), `ReplicaSpec`
is what one Ray actor needs to start its `fornax serve` (it travels to the actor, so it is
plain data), and `ClusterConfig` is the controller's whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fornax.config import ConfigError

DEFAULT_ROUTER_PORT = 8080
DEFAULT_POLICY = "cache-aware"


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    # Average `fornax:num_requests_waiting` per replica the cluster aims at: above it for
    # `scale_up_delay_s`, one replica is added.
    target_waiting: float = 4.0
    # At or below this average for `scale_down_cooldown_s`, one replica is drained. 0: only
    # when nobody waits anywhere; a replica whose batch still has room adds no queue.
    scale_down_waiting: float = 0.0
    scale_up_delay_s: float = 5.0  # a burst shorter than this does not buy a replica
    # Longer than the delay up: a replica costs seconds to load, so it is kept through a lull.
    scale_down_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError("--min-replicas must be at least 1")
        if self.max_replicas < self.min_replicas:
            raise ConfigError("--max-replicas must be at least --min-replicas")
        if self.scale_down_waiting > self.target_waiting:
            raise ConfigError("the scale-down mark must not be above --target-waiting")
        if self.scale_up_delay_s < 0 or self.scale_down_cooldown_s < 0:
            raise ConfigError("scaling delays must not be negative")


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica's `fornax serve`: MODEL, the pass-through flags, and where it listens."""

    model: str
    serve_args: tuple[str, ...] = ()  # flags given to every replica as is (--max-model-len 256 ...)
    # Also the actor's num_cpus, so Ray never puts two replicas' threads on one core. None:
    # the Ray cluster's CPUs / max replicas, resolved by the controller once Ray is up.
    num_threads: int | None = None
    # Address the server binds and is reached at; None: the Ray node's IP (multi-node clusters).
    host: str | None = "127.0.0.1"
    shutdown_timeout_s: float = 30.0  # --shutdown-timeout: how long drain() waits for in-flight requests
    ready_timeout_s: float = 300.0  # model download and load
    # A key the actor reads /metrics with when the replicas have keys (None: an open server).
    metrics_key: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra environment (FORNAX_HOME) for the server


@dataclass(frozen=True)
class ClusterConfig:
    replica: ReplicaSpec
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    replicas: int = 1  # started at once; the autoscaler then moves within the policy's bounds
    ray_address: str | None = None  # None: start a local Ray runtime with this machine's CPUs
    router_host: str = "127.0.0.1"
    router_port: int = DEFAULT_ROUTER_PORT
    policy: str = DEFAULT_POLICY
    router_args: tuple[str, ...] = ()  # more `fornax router` flags (the clients' --api-key)
    # The router has keys, so the controller gives it one more admin key of its own for
    # /router/*. Without keys the router is open, /router/* included, like an open `fornax
    # serve` and its /admin/*: keep it on loopback, or give keys.
    router_auth: bool = False
    # Ray restarts a replica whose actor died this many times (-1: always); a restarted actor
    # starts a new server on a new port, which the membership loop hands to the router.
    max_restarts: int = 5
    poll_interval_s: float = 1.0  # membership and load are read this often
    # Between leaving the router and SIGTERM: requests the router already sent arrive first.
    drain_grace_s: float = 1.0
    router_ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.scaling.min_replicas <= self.replicas <= self.scaling.max_replicas:
            raise ConfigError(
                f"--replicas {self.replicas} must lie within --min-replicas "
                f"{self.scaling.min_replicas} and --max-replicas {self.scaling.max_replicas}"
            )
        if self.max_restarts < -1:
            raise ConfigError("--max-restarts must be -1 (always) or at least 0")
        if self.poll_interval_s <= 0:
            raise ConfigError("the poll interval must be positive")
