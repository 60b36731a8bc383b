"""`fornax cluster up MODEL ...` and `fornax serve MODEL --replicas N`: the controller's CLI.

`up` takes every `fornax serve` flag and passes the ones given on to each replica as is
(`--max-model-len 256`, `--quantization auto`, keys...), except those the cluster sets per
replica: --host/--port (here: the router's, the address clients use), --num-threads
(--threads-per-replica) and --shutdown-timeout (also the drain's). Ray is imported only
when a cluster is started: `import fornax` and `fornax serve` never need it.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import threading
from typing import Any

from fornax.cluster.config import (
    DEFAULT_POLICY,
    DEFAULT_ROUTER_PORT,
    ClusterConfig,
    ReplicaSpec,
    ScalingPolicy,
)
from fornax.config import DEFAULT_MODEL, ConfigError
from fornax.engine_args import EngineArgs
from fornax.server_args import ServerArgs, add_serve_args

# serve flags the cluster sets for each replica itself (never passed through)
_OWN_DESTS = ("model_arg", "model", "host", "port", "num_threads", "shutdown_timeout")


def add_replicas_arg(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N replicas on a local Ray runtime behind `fornax router` on "
        "--host/--port (`fornax cluster up` with min = max = N; needs fornax[cluster])",
    )


def add_cluster_parser(sub: Any) -> None:
    from fornax.router.policies import policy_names

    cluster = sub.add_parser(
        "cluster", help="run replicas on Ray behind the router, restarted and autoscaled"
    )
    actions = cluster.add_subparsers(dest="cluster_command", required=True)
    up = actions.add_parser("up", help="start a cluster and run it until SIGTERM/Ctrl-C (then drain it)")
    add_serve_args(up)  # every serve flag: those given pass on to the replicas (passthrough_args)
    up.set_defaults(port=DEFAULT_ROUTER_PORT)  # --host/--port: the router's here
    g = up.add_argument_group("cluster")
    g.add_argument(
        "--router-port", dest="port", type=int, help=f"same as --port (default {DEFAULT_ROUTER_PORT})"
    )
    g.add_argument(
        "--replicas", type=int, default=None, help="replicas to start (default: --min-replicas or 1)"
    )
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling floor (default: --replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling ceiling (default: --replicas)")
    g.add_argument(
        "--threads-per-replica",
        dest="num_threads",
        type=int,
        default=None,
        help="each replica's compute threads and Ray CPUs (default: the cluster's CPUs / max replicas)",
    )
    g.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start one here)")
    g.add_argument(
        "--policy", default=DEFAULT_POLICY, choices=policy_names(), help="the router's routing policy"
    )
    s, r = ScalingPolicy(), ClusterConfig(replica=ReplicaSpec(model=""))
    g.add_argument(
        "--target-waiting",
        type=float,
        default=s.target_waiting,
        help="scale up when the average fornax:num_requests_waiting per replica stays above this",
    )
    g.add_argument(
        "--scale-down-waiting",
        type=float,
        default=s.scale_down_waiting,
        help="scale down when it stays at or below this",
    )
    g.add_argument("--scale-up-delay", type=float, default=s.scale_up_delay_s, help="seconds above target")
    g.add_argument(
        "--scale-down-cooldown",
        type=float,
        default=s.scale_down_cooldown_s,
        help="seconds at or below the scale-down mark",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=r.max_restarts,
        help="times Ray restarts a dead replica (-1: always)",
    )


def run_cluster(args: argparse.Namespace) -> int:
    if args.cluster_command == "up":
        return cluster_up(args)
    raise ConfigError(f"unknown cluster command {args.cluster_command!r}")


def serve_replicas(args: argparse.Namespace) -> int:
    """`fornax serve MODEL --replicas N`: a fixed-size cluster on --host/--port."""
    return cluster_up(args)


def cluster_up(args: argparse.Namespace) -> int:
    config = cluster_config(args)  # bad flags are told without Ray
    _require_ray()
    from fornax.cluster.controller import ClusterController, ClusterError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per membership poll
    controller = ClusterController(config)
    try:
        controller.start()
    except ClusterError as exc:
        print(f"fornax: error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    _stop_on_signals(stop)
    s = config.scaling
    print(
        f"fornax cluster: {config.replicas} replica(s) of {config.replica.model} "
        f"(scaling {s.min_replicas}..{s.max_replicas}) behind {controller.router_url}; Ctrl-C to drain and stop",
        file=sys.stderr,
    )
    try:
        controller.run(stop)
    finally:
        controller.shutdown()
    return 0


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("`fornax cluster` needs Ray: pip install 'fornax[cluster]'") from None


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM/Ctrl-C end the control loop; the shutdown (drain, router, Ray) then runs in the
    main thread. Later signals are ignored: the drain has its own timeouts."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            print("fornax cluster: already draining", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """A ClusterConfig from `cluster up` (or `serve --replicas`) arguments."""
    replicas = getattr(args, "replicas", None) or getattr(args, "min_replicas", None) or 1
    low = getattr(args, "min_replicas", None) or replicas
    high = getattr(args, "max_replicas", None) or max(replicas, low)
    s = ScalingPolicy()
    scaling = ScalingPolicy(
        min_replicas=low,
        max_replicas=high,
        target_waiting=getattr(args, "target_waiting", s.target_waiting),
        scale_down_waiting=getattr(args, "scale_down_waiting", s.scale_down_waiting),
        scale_up_delay_s=getattr(args, "scale_up_delay", s.scale_up_delay_s),
        scale_down_cooldown_s=getattr(args, "scale_down_cooldown", s.scale_down_cooldown_s),
    )
    ray_address = getattr(args, "ray_address", None)
    serve_args, metrics_key = passthrough_args(args)
    replica = ReplicaSpec(
        model=args.model_arg or (args.model or [DEFAULT_MODEL])[0],
        serve_args=tuple(serve_args),
        num_threads=args.num_threads,
        # A local Ray runtime: replicas on loopback, reached only through the router. On a Ray
        # cluster they run on other machines: their node's address.
        host="127.0.0.1" if ray_address is None else None,
        shutdown_timeout_s=args.shutdown_timeout,
        metrics_key=metrics_key,
    )
    defaults = ClusterConfig(replica=replica)
    return ClusterConfig(
        replica=replica,
        scaling=scaling,
        replicas=replicas,
        ray_address=ray_address,
        router_host=args.host,
        router_port=args.port,
        policy=getattr(args, "policy", DEFAULT_POLICY),
        router_args=tuple(router_key_args(args)),
        router_auth=metrics_key is not None,
        max_restarts=getattr(args, "max_restarts", defaults.max_restarts),
    )


def passthrough_args(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The serve settings given (not at their defaults), as argv for each replica, rendered
    from EngineArgs' and ServerArgs' fields; and, when the replicas have keys, a generated
    admin key the replica actors read /metrics with."""
    server = ServerArgs.from_cli_args(args)
    argv = EngineArgs.from_cli_args(args).as_argv("serve", exclude=_OWN_DESTS)
    argv += server.as_argv(exclude=_OWN_DESTS)
    if not (server.api_keys() or server.admin_keys()):
        return argv, None  # an open server: /metrics needs no key
    key = secrets.token_urlsafe(24)
    return [*argv, "--admin-key", f"fornax-cluster:{key}"], key


def router_key_args(args: argparse.Namespace) -> list[str]:
    """The keys, for the router too: clients authenticate at the front door, and the router
    passes their Authorization on, so each replica still knows whose request it is."""
    pairs = [("--api-key", key) for key in args.api_key or ()]
    pairs += [("--admin-key", key) for key in args.admin_key or ()]
    pairs += [
        (flag, path)
        for flag, path in (("--api-key-file", args.api_key_file), ("--admin-key-file", args.admin_key_file))
        if path
    ]
    return [f"{flag}={value}" for flag, value in pairs]  # "=": a key may start with "-"
