"""Routing policies: a small Protocol and a registry keyed by the --policy name.

Every policy gets the candidates already filtered (in rotation, ready, serving the request's
model, not yet tried by this request) and never an empty list; it returns the replica and a
reason, which becomes the `x-fornax-route-reason` header and a metrics label.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fornax.config import ConfigError
from fornax.router.config import RouterConfig
from fornax.router.prompt import RouteRequest
from fornax.router.radix import PrefixTree
from fornax.router.replicas import Replica


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # cache_hit, cache_miss, balance_fallback, least_load, round_robin, long_pool, ...
    match_ratio: float | None = None  # cache-aware only: share of the prompt already cached there


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision: ...

    def forget(self, url: str) -> None:
        """A replica left the set: drop whatever the policy remembers about it."""


PolicyFactory = Callable[[RouterConfig], Policy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def add(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return add


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(config: RouterConfig) -> Policy:
    factory = _REGISTRY.get(config.policy)
    if factory is None:
        raise ConfigError(f"unknown routing policy {config.policy!r}; known: {', '.join(policy_names())}")
    return factory(config)


class Rotor:
    """Turns ties into a rotation, so equally loaded replicas share a burst evenly."""

    def __init__(self) -> None:
        self._n = 0

    def pick(self, items: Sequence[Replica]) -> Replica:
        self._n += 1
        return items[self._n % len(items)]


def least_loaded(candidates: Sequence[Replica], rotor: Rotor) -> Replica:
    """The replica with the least load (then KV usage, then this router's in-flight count)."""
    keys = [(r.load, r.kv_usage, r.inflight) for r in candidates]
    best = min(keys)
    ties = [r for r, key in zip(candidates, keys) if key == best]
    return ties[0] if len(ties) == 1 else rotor.pick(ties)


def imbalanced(candidates: Sequence[Replica], abs_threshold: float, rel_threshold: float) -> bool:
    """The busiest replica's load exceeds the idlest's by both thresholds."""
    loads = [r.load for r in candidates]
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > low * rel_threshold


@register("round-robin")
class RoundRobin:
    name = "round-robin"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self._n = -1

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        self._n += 1
        return Decision(candidates[self._n % len(candidates)], "round_robin")

    def forget(self, url: str) -> None:
        pass


@register("least-load")
class LeastLoad:
    name = "least-load"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self._rotor = Rotor()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        return Decision(least_loaded(candidates, self._rotor), "least_load")

    def forget(self, url: str) -> None:
        pass


@register("cache-aware")
class CacheAware:
    """The replica holding the longest prefix of the prompt, if it covers `cache_threshold`
    of it, else the least loaded; least-load outright while the candidates are imbalanced.
    Every routed prompt is recorded for the replica it went to."""

    name = "cache-aware"

    def __init__(self, config: RouterConfig) -> None:
        self.tree = PrefixTree(config.cache_max_chars)
        self.threshold = config.cache_threshold
        self.balance = (config.balance_abs_threshold, config.balance_rel_threshold)
        self._rotor = Rotor()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        text = request.text
        if len(candidates) > 1 and imbalanced(candidates, *self.balance):
            decision = Decision(least_loaded(candidates, self._rotor), "balance_fallback")
        else:
            match = self.tree.match(text, {r.url for r in candidates}) if text else None
            ratio = match.ratio(len(text)) if match is not None else 0.0
            if match is not None and match.owners and ratio >= self.threshold:
                owners = [r for r in candidates if r.url in match.owners]
                decision = Decision(least_loaded(owners, self._rotor), "cache_hit", ratio)
            else:
                decision = Decision(least_loaded(candidates, self._rotor), "cache_miss", ratio)
        if text:
            self.tree.insert(text, decision.replica.url)
        return decision

    def forget(self, url: str) -> None:
        self.tree.remove_owner(url)


@register("length")
class Length:
    """Prompts over `long_prompt_tokens` (estimated, see prompt.py) to the replicas tagged
    with `long_pool_tag`, the others to the rest; the least loaded within the pool, and
    any replica when the pool has none available."""

    name = "length"

    def __init__(self, config: RouterConfig) -> None:
        self.limit = config.long_prompt_tokens
        self.tag = config.long_pool_tag
        self._rotor = Rotor()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        long = request.est_tokens > self.limit
        pool = [r for r in candidates if r.tagged(*self.tag) == long]
        if not pool:
            return Decision(least_loaded(candidates, self._rotor), "pool_fallback")
        return Decision(least_loaded(pool, self._rotor), "long_pool" if long else "short_pool")

    def forget(self, url: str) -> None:
        pass
