"""Tenants: who may see which requests, whose cached prefixes a request may reuse, and what a
key may spend.

Roles. A key is a user's (`--api-key`) or an operator's (`--admin-key`). Admins may do all a
user may, plus /admin/* (auth.Gate answers 403 to users there). With no key configured the
server is open and every client is the admin "anonymous" (the behaviour before roles).

Visibility. The server records which key submitted each engine request id (`Owners`). A
user's /v1/fornax/events stream carries only that user's requests' events, with other
requests' ids in a batch reduced to the batch size; a user may follow (`?request_id=`) only
an own request. A user's /v1/fornax/live snapshot lists only their own running and waiting
requests; the aggregate numbers (counts, KV usage, throughput, latencies) stay. Admins see
everything. An id the server no longer remembers counts as someone else's (fail closed).

Cache scope. With `--prefix-cache-scope key` each request carries a cache salt derived from
its key name (plus the request's own `cache_salt`, as in vLLM); the engine mixes it into the
first block's hash, so two tenants' hash chains never meet and `cached_tokens` cannot tell
one tenant what another has sent.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fornax.config import ServerConfig
from fornax.engine.events import Event
from fornax.engine.request import SamplingParams
from fornax.server.errors import ApiError
from fornax.server.rate_limit import RateLimited, RateLimiter

USER, ADMIN = "user", "admin"
# Request ids remembered with their owner. The event bus replays at most its last 64 requests,
# and a live snapshot shows only requests in flight, so this only has to outlast those; ids
# are ~40 bytes, so this is well under a few MB.
MAX_OWNERS = 16_384


@dataclass(frozen=True)
class Viewer:
    """Who is reading an event stream or a snapshot."""

    name: str
    admin: bool


class Owners:
    """Engine request id -> the key name that submitted it, for the most recent requests."""

    def __init__(self, capacity: int = MAX_OWNERS) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def add(self, request_ids: Iterable[str], key: str) -> None:
        for request_id in request_ids:
            self._owner[request_id] = key
            self._owner.move_to_end(request_id)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def get(self, request_id: str) -> str | None:
        return self._owner.get(request_id)


class Tenancy:
    """The server's tenancy rules; one lives on ServerState."""

    def __init__(self, config: ServerConfig) -> None:
        self.scope = config.prefix_cache_scope
        self.owners = Owners()
        self.limiter = RateLimiter(config.rate_limits)

    # -- admission ---------------------------------------------------------------------------------------

    def admit(
        self, key: str, request_id: str, prompts: list[list[int]], params: SamplingParams, max_model_len: int
    ) -> None:
        """Take the request's worst-case tokens from the key's budget, or answer 429. The
        reservation is corrected when the request ends (ServerState.finish -> settle); one
        that never starts (its client left first) keeps it until it leaves the window."""
        cost = sum(len(p) + params.n * _room(params, len(p), max_model_len) for p in prompts)
        try:
            self.limiter.acquire(key, request_id, cost)
        except RateLimited as exc:
            headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
            raise ApiError(429, exc.message, code="rate_limit_exceeded", headers=headers) from None

    def settle(self, request_id: str, tokens_used: int) -> None:
        self.limiter.settle(request_id, tokens_used)

    def claim(self, request_ids: Iterable[str], key: str) -> None:
        """Record the owner of engine requests; before they reach the engine, so that their
        first event already has an owner."""
        self.owners.add(request_ids, key)

    def cache_salt(self, key: str, request_salt: str | None) -> str | None:
        """The salt the engine mixes into the request's first block hash (None: no salt).

        JSON of [key, salt] keeps the pair injective whatever characters either holds: a key
        name and a client's salt can never be combined to imitate another (key, salt) pair.
        """
        owner = key if self.scope == "key" else None
        if owner is None and request_salt is None:
            return None
        return json.dumps([owner, request_salt])

    # -- visibility --------------------------------------------------------------------------------------

    def may_see(self, viewer: Viewer, request_id: str) -> bool:
        return viewer.admin or self.owners.get(request_id) == viewer.name

    def event_for(self, viewer: Viewer, event: Event) -> dict[str, Any] | None:
        """The event as `viewer` may see it, or None if it is someone else's."""
        if viewer.admin:
            return event.to_json()
        if not self.may_see(viewer, event.request_id):
            return None
        out = event.to_json()
        if "batch" in out:  # the other requests of its step: own ones by id, the rest only counted
            out["batch"] = [rid for rid in out["batch"] if self.may_see(viewer, rid)]
        return out

    def snapshot_for(self, viewer: Viewer, snapshot: dict[str, Any]) -> dict[str, Any]:
        """A live snapshot as `viewer` may see it: only own requests listed, counts kept."""
        if viewer.admin:
            return snapshot
        out = dict(snapshot)
        for name in ("running", "waiting"):
            if name in out:
                out[name] = [r for r in out[name] if self.may_see(viewer, r["request_id"])]
        return out

    # -- reporting ---------------------------------------------------------------------------------------

    def usage(self, usage: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per-key usage (from ServerState) with each key's rate-limit window and refusals."""
        out = {name: dict(u) for name, u in usage.items()}
        for name in set(out) | set(self.limiter.keys()):
            out.setdefault(name, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
            window = self.limiter.usage(name)
            out[name]["rejected_rate_limited"] = window.pop("rejected_rate_limited")
            out[name]["rate_limit"] = window
        return out


def log_tenancy(config: ServerConfig, logger: logging.Logger) -> None:
    """At startup: who may call the server, and the rules that keep its tenants apart."""
    users, admins = len(config.api_keys), len(config.admin_keys)
    if not users and not admins:
        logger.warning(
            "no API key configured: the server is open to anyone who can reach %s:%d "
            "(use --api-key, --api-key-file or FORNAX_API_KEY)",
            config.host,
            config.port,
        )
    elif not admins:
        logger.warning(
            "no admin key configured: /admin/* answers 403 to every key "
            "(use --admin-key, --admin-key-file or FORNAX_ADMIN_KEY)"
        )
    limits = (
        ", ".join(
            f"{name}: {lim.requests_per_minute or '-'} req/min, {lim.tokens_per_minute or '-'} tok/min"
            for name, lim in config.rate_limits
        )
        or "none"
    )
    logger.info(
        "%d user key(s), %d admin key(s); prefix cache scope: %s; rate limits: %s",
        users,
        admins,
        config.prefix_cache_scope,
        limits,
    )


def _room(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens one choice of this prompt may generate (what the engine will allow)."""
    room = max(max_model_len - num_prompt_tokens, 0)
    return room if params.max_tokens is None else min(params.max_tokens, room)
