"""Per-key rate limits: requests and tokens per minute over a sliding 60-second window.

Why a sliding log and not a token bucket: a log of what each key was admitted in the last
60 s answers "how many requests" and "how many tokens" exactly, lets a finished request's
reservation be corrected in place, and tells a refused client exactly when enough of the
log leaves the window (Retry-After). It costs one small entry per admitted request, and a
key's log never holds more than its requests_per_minute entries (or tokens_per_minute
over the smallest request, 2 tokens), so memory stays bounded for any limited key.
Unlimited keys keep no log at all.

How tokens count (documented for clients in `fornax serve --help`): at admission a request
reserves its prompt tokens plus the most it may generate (max_tokens for each of its `n`
choices, capped by the context left); when it ends, its entry is corrected to the prompt
plus the completion tokens actually produced. So a key's in-flight requests are budgeted at
their worst case, while finished ones cost what they really used. A request whose worst
case alone exceeds tokens_per_minute can never be admitted: it is refused without
Retry-After, and the message says to lower max_tokens.

Not thread-safe: everything runs in the server's event loop.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fornax.config import RateLimit

WINDOW_S = 60.0


class RateLimited(Exception):
    """A refusal; `retry_after_s` is None when waiting cannot help (the request is too large)."""

    def __init__(self, message: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


@dataclass
class _Entry:
    time: float  # when it was admitted (the limiter's clock)
    tokens: int  # reserved, then corrected to actual use
    request_id: str


@dataclass
class _Log:
    entries: deque[_Entry] = field(default_factory=deque)  # oldest first
    tokens: int = 0  # sum of the entries' tokens, kept in step with `entries`
    rejected: int = 0  # refusals since start (for /admin/usage)


class RateLimiter:
    def __init__(
        self,
        limits: tuple[tuple[str, RateLimit], ...] = (),
        clock: Callable[[], float] = time.monotonic,
        window_s: float = WINDOW_S,
    ) -> None:
        self._limits = dict(limits)
        self._default = self._limits.pop("*", RateLimit())
        self.clock, self.window_s = clock, window_s
        self._logs: dict[str, _Log] = {}
        self._pending: dict[str, tuple[str, _Entry]] = {}  # request id -> (key, its entry), until settled

    @property
    def enabled(self) -> bool:
        return not self._default.unlimited or any(not lim.unlimited for lim in self._limits.values())

    def limit_for(self, key: str) -> RateLimit:
        return self._limits.get(key, self._default)

    def acquire(self, key: str, request_id: str, tokens: int) -> None:
        """Admit one request costing (at most) `tokens` for `key`, or raise RateLimited."""
        limit = self.limit_for(key)
        if limit.unlimited:
            return
        now = self.clock()
        log = self._prune(key, now)
        try:
            self._check(limit, log, tokens, now)
        except RateLimited:
            log.rejected += 1
            raise
        entry = _Entry(now, tokens, request_id)
        log.entries.append(entry)
        log.tokens += tokens
        self._pending[request_id] = (key, entry)

    def settle(self, request_id: str, tokens: int) -> None:
        """A request ended having used `tokens`: its entry counts that from now on (if it is
        still in the window; an entry that has left it no longer counts at all)."""
        found = self._pending.pop(request_id, None)
        if found is None:
            return
        key, entry = found
        now = self.clock()
        log = self._prune(key, now)
        if entry.time + self.window_s > now:  # still in the window (else pruned: counts nothing)
            log.tokens += tokens - entry.tokens
            entry.tokens = tokens

    def usage(self, key: str) -> dict[str, Any]:
        """What /admin/usage shows per key: its limits, the window's use, refusals so far."""
        limit = self.limit_for(key)
        log = self._prune(key, self.clock()) if key in self._logs else _Log()
        return {
            "requests_per_minute": limit.requests_per_minute,
            "tokens_per_minute": limit.tokens_per_minute,
            "window_requests": len(log.entries),
            "window_tokens": log.tokens,
            "rejected_rate_limited": log.rejected,
        }

    def keys(self) -> list[str]:
        return list(self._logs)

    def _prune(self, key: str, now: float) -> _Log:
        """The key's log without the entries that have left the window."""
        log = self._logs.setdefault(key, _Log())
        while log.entries and log.entries[0].time + self.window_s <= now:
            old = log.entries.popleft()
            log.tokens -= old.tokens
            self._pending.pop(old.request_id, None)
        return log

    def _check(self, limit: RateLimit, log: _Log, tokens: int, now: float) -> None:
        rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise RateLimited(
                f"this request may use up to {tokens} tokens (prompt plus max_tokens for each choice), more "
                f"than this key's limit of {tpm} tokens per minute; lower max_tokens or shorten the prompt",
                None,
            )
        waits: list[tuple[float, str]] = []  # (when it would be admitted, which limit)
        if rpm is not None and len(log.entries) + 1 > rpm:
            # The oldest (count - rpm + 1) entries must leave: the last of them decides.
            waits.append((log.entries[len(log.entries) - rpm].time + self.window_s, f"{rpm} requests"))
        if tpm is not None and log.tokens + tokens > tpm:
            waits.append((self._token_wait(log, log.tokens + tokens - tpm), f"{tpm} tokens"))
        if waits:
            when, what = max(waits)
            wait = max(1, math.ceil(when - now))  # whole seconds, as Retry-After wants; never 0
            raise RateLimited(
                f"rate limit of {what} per minute reached for this key; retry in {wait} s", wait
            )

    def _token_wait(self, log: _Log, excess: int) -> float:
        """When enough of the oldest entries have left the window to free `excess` tokens."""
        freed = 0
        for entry in log.entries:
            freed += entry.tokens
            if freed >= excess:
                return entry.time + self.window_s
        raise AssertionError("unreachable: the request alone fits the limit")
