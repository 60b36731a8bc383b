"""RateLimiter: requests and tokens per minute over a sliding window, on an injected clock."""

from __future__ import annotations

import pytest

from fornax.config import RateLimit
from fornax.server.rate_limit import RateLimited, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, **limits: RateLimit) -> RateLimiter:
    return RateLimiter(tuple(limits.items()), clock=clock)


def refused(lim: RateLimiter, key: str, rid: str, tokens: int) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        lim.acquire(key, rid, tokens)
    return info.value


def test_requests_per_minute_slide_with_the_window() -> None:
    clock = Clock()
    lim = limiter(clock, alice=RateLimit(requests_per_minute=2))
    lim.acquire("alice", "a1", 10)
    clock.now += 20
    lim.acquire("alice", "a2", 10)
    clock.now += 10  # t = 30: a1 leaves the window at t = 60
    err = refused(lim, "alice", "a3", 10)
    assert err.retry_after_s == 30 and "2 requests" in err.message
    clock.now += 29.5  # t = 59.5: still inside; rounded up, never 0
    assert refused(lim, "alice", "a3", 10).retry_after_s == 1
    clock.now += 0.5  # t = 60: a1 has left
    lim.acquire("alice", "a3", 10)
    assert lim.usage("alice") == {
        "requests_per_minute": 2,
        "tokens_per_minute": None,
        "window_requests": 2,
        "window_tokens": 20,
        "rejected_rate_limited": 2,
    }


def test_tokens_per_minute_wait_for_enough_tokens_to_leave() -> None:
    clock = Clock()
    lim = limiter(clock, **{"*": RateLimit(tokens_per_minute=100)})
    lim.acquire("bob", "b1", 30)  # t = 0
    clock.now += 10
    lim.acquire("bob", "b2", 50)  # t = 10
    clock.now += 5  # t = 15: 80 used; 40 more need 20 to leave: b1 at t = 60 frees 30
    err = refused(lim, "bob", "b3", 40)
    assert err.retry_after_s == 45 and "100 tokens" in err.message
    assert refused(lim, "bob", "b3", 90).retry_after_s == 55  # needs b2 gone too (t = 70)
    lim.acquire("bob", "b4", 20)  # exactly fills the budget
    assert lim.usage("bob")["window_tokens"] == 100


def test_settle_returns_unused_reserved_tokens() -> None:
    clock = Clock()
    lim = limiter(clock, carol=RateLimit(tokens_per_minute=100))
    lim.acquire("carol", "c1", 90)  # prompt + max_tokens, reserved
    refused(lim, "carol", "c2", 20)
    lim.settle("c1", 25)  # it used 25
    lim.acquire("carol", "c2", 20)
    assert lim.usage("carol")["window_tokens"] == 45
    lim.settle("c1", 1)  # settled once: a second correction is ignored
    lim.settle("unknown", 5)
    assert lim.usage("carol")["window_tokens"] == 45


def test_settle_after_the_entry_left_the_window_changes_nothing() -> None:
    clock = Clock()
    lim = limiter(clock, carol=RateLimit(tokens_per_minute=100))
    lim.acquire("carol", "c1", 90)
    clock.now += 61  # a request that ran for over a minute
    lim.acquire("carol", "c2", 10)
    lim.settle("c1", 200)
    assert lim.usage("carol")["window_tokens"] == 10


def test_a_request_larger_than_the_limit_is_refused_without_retry_after() -> None:
    clock = Clock()
    lim = limiter(clock, dave=RateLimit(tokens_per_minute=100))
    err = refused(lim, "dave", "d1", 101)
    assert err.retry_after_s is None and "max_tokens" in err.message
    assert lim.usage("dave")["rejected_rate_limited"] == 1


def test_keys_are_separate_and_defaults_apply_to_unnamed_keys() -> None:
    clock = Clock()
    lim = limiter(clock, alice=RateLimit(requests_per_minute=1), **{"*": RateLimit(requests_per_minute=2)})
    lim.acquire("alice", "a1", 1)
    refused(lim, "alice", "a2", 1)
    lim.acquire("bob", "b1", 1)  # alice's use does not count against bob
    lim.acquire("bob", "b2", 1)
    refused(lim, "bob", "b3", 1)
    lim.acquire("erin", "e1", 1)  # every key has its own window under the default
    assert lim.enabled


def test_unlimited_keys_keep_no_log() -> None:
    clock = Clock()
    lim = limiter(clock, alice=RateLimit(requests_per_minute=1))
    for i in range(100):
        lim.acquire("bob", f"b{i}", 10**6)
    assert lim.keys() == [] and lim.usage("bob")["window_requests"] == 0
    assert not RateLimiter((), clock=clock).enabled
