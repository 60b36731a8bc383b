"""`fornax router`: its flags (defaults from RouterConfig) and its command."""

from __future__ import annotations

import argparse
import logging

from fornax.config import load_admin_keys, load_api_keys, parse_memory_size
from fornax.router.config import RouterConfig, parse_dns, parse_replica, parse_tag_pair
from fornax.router.policies import policy_names


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = RouterConfig()
    p = sub.add_parser("router", help="route OpenAI requests over several fornax replicas")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL[#k=v,...]",
        help="a replica's base URL, optionally tagged (e.g. http://h1:8000#tag=long); repeatable",
    )
    p.add_argument(
        "--replica-dns",
        action="append",
        default=[],
        metavar="NAME:PORT[#k=v,...]",
        help="replicas at every A/AAAA address of NAME (re-resolved every poll interval)",
    )
    p.add_argument("--policy", default=d.policy, choices=policy_names())
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", action="append", default=[], help="a client's key, [name:]key (repeatable)")
    p.add_argument("--api-key-file", default=None, help="file with one client key (or name:key) per line")
    p.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help="an operator's key (repeatable): also /router/replicas",
    )
    p.add_argument("--admin-key-file", default=None)
    p.add_argument(
        "--replica-api-key",
        default=None,
        help="the key sent to replicas with relayed requests, in place of the client's "
        "(default: the client's Authorization header is passed on)",
    )
    p.add_argument(
        "--replica-poll-key",
        default=None,
        help="the key sent only with the router's own polls of replicas (/health, /metrics, "
        "/v1/models), e.g. a replica admin key; clients' keys still reach the replicas "
        "(default: --replica-api-key, if given)",
    )
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=d.access_log)
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    _add_health_args(p, d)
    _add_policy_args(p, d)
    return p


def _add_health_args(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    g = p.add_argument_group("health and failover")
    g.add_argument(
        "--poll-interval",
        type=float,
        default=d.poll_interval_s,
        help="seconds between polls of each replica's /health, /metrics, /v1/models",
    )
    g.add_argument("--poll-timeout", type=float, default=d.poll_timeout_s)
    g.add_argument(
        "--unhealthy-after",
        type=int,
        default=d.unhealthy_after,
        help="consecutive failed health checks that take a replica out",
    )
    g.add_argument(
        "--healthy-after",
        type=int,
        default=d.healthy_after,
        help="consecutive good health checks that bring an ejected replica back",
    )
    g.add_argument("--max-attempts", type=int, default=d.max_attempts, help="replicas tried per request")
    g.add_argument(
        "--backoff-base", type=float, default=d.backoff_base_s, help="seconds before the first retry"
    )
    g.add_argument("--backoff-max", type=float, default=d.backoff_max_s)
    g.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s)
    g.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout_s,
        help="longest silence from a replica before the attempt fails",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="connections to replicas, all together (requests beyond wait for one)",
    )
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)


def _add_policy_args(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    g = p.add_argument_group("policies")
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=d.cache_threshold,
        help="cache-aware: share of the prompt a replica's recorded prefix must cover",
    )
    g.add_argument("--balance-abs-threshold", type=float, default=d.balance_abs_threshold)
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold)
    g.add_argument(
        "--cache-max-chars",
        default=str(d.cache_max_chars),
        help="cache-aware: size cap of the prefix tree, in characters (e.g. 8M)",
    )
    g.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=d.long_prompt_tokens,
        help="length: estimated prompt tokens above which the long pool serves",
    )
    g.add_argument(
        "--long-pool-tag",
        default="=".join(d.long_pool_tag),
        metavar="KEY=VALUE",
        help="length: the tag of the long pool's replicas",
    )


def _chars(value: str) -> int:
    """'8M' -> 8388608 (binary units, as memory sizes); a plain number is a count."""
    return int(value) if value.strip().isdigit() else parse_memory_size(value)


def router_config(args: argparse.Namespace) -> RouterConfig:
    # No replica at all is allowed: an orchestrator may add them later (POST /router/replicas).
    return RouterConfig(
        replicas=tuple(parse_replica(v) for v in args.replica),
        replica_dns=tuple(parse_dns(v) for v in args.replica_dns),
        policy=args.policy,
        host=args.host,
        port=args.port,
        api_keys=load_api_keys(args.api_key, args.api_key_file),
        admin_keys=load_admin_keys(args.admin_key, args.admin_key_file),
        replica_api_key=args.replica_api_key,
        replica_poll_key=args.replica_poll_key,
        public_metrics=args.public_metrics,
        access_log=args.access_log,
        log_level=args.log_level,
        poll_interval_s=args.poll_interval,
        poll_timeout_s=args.poll_timeout,
        unhealthy_after=args.unhealthy_after,
        healthy_after=args.healthy_after,
        max_attempts=args.max_attempts,
        backoff_base_s=args.backoff_base,
        backoff_max_s=args.backoff_max,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        max_body_bytes=args.max_body_bytes,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        cache_max_chars=_chars(args.cache_max_chars),
        long_prompt_tokens=args.long_prompt_tokens,
        long_pool_tag=parse_tag_pair(args.long_pool_tag),
    )


def cmd_router(args: argparse.Namespace) -> int:
    from fornax.router.app import serve

    config = router_config(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(config)
