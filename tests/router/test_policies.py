"""Each policy's decision on synthetic replica states, the load definition, and what
routing reads from a request body."""

from __future__ import annotations

import pytest

from fornax.config import ConfigError
from fornax.router.config import RouterConfig
from fornax.router.policies import CacheAware, Length, make_policy, policy_names
from fornax.router.prompt import RouteRequest, chat_text, completion_text, route_request
from fornax.router.replicas import Replica


def replica(url: str, running: float = 0, waiting: float = 0, tags: dict[str, str] | None = None) -> Replica:
    r = Replica(f"http://{url}:8000", tags or {})
    r.health.check_ok()
    r.running, r.waiting = running, waiting
    return r


def chat(text: str) -> RouteRequest:
    return route_request("chat", {"messages": [{"role": "user", "content": text}]})


def policy(name: str, **kw: object) -> object:
    return make_policy(RouterConfig(policy=name, **kw))


def test_registry() -> None:
    assert policy_names() == ["cache-aware", "least-load", "length", "round-robin"]
    with pytest.raises(ConfigError, match="unknown routing policy"):
        make_policy(RouterConfig(policy="random"))


def test_round_robin() -> None:
    p = policy("round-robin")
    reps = [replica("a"), replica("b"), replica("c")]
    picks = [p.choose(chat("x"), reps) for _ in range(6)]
    assert [d.replica.url[7] for d in picks] == list("abcabc")
    assert {d.reason for d in picks} == {"round_robin"}


def test_least_load_and_ties_rotate() -> None:
    p = policy("least-load")
    a, b, c = replica("a", running=3), replica("b", running=1, waiting=1), replica("c", waiting=5)
    d = p.choose(chat("x"), [a, b, c])
    assert d.replica is b and d.reason == "least_load"
    idle = [replica("x"), replica("y")]
    assert {p.choose(chat("x"), idle).replica.url for _ in range(4)} == {r.url for r in idle}


def test_load_counts_requests_the_last_scrape_cannot_have_seen() -> None:
    r = replica("a")
    first = r.begin_request()  # sent before the scrape below: the scrape counts it
    mark = r.begin_scrape()
    second = r.begin_request()  # sent while the scrape was on its way: not in its numbers
    assert r.load == 2 and r.inflight == 2
    r.apply_scrape(mark, running=1, waiting=0, kv_usage=0.1)
    assert r.load == 1 + 1  # polled running (the first) + the second
    r.end_request(first)  # it was reflected: the polled numbers keep it until the next scrape
    assert r.load == 2 and r.inflight == 1
    r.end_request(second)
    assert r.load == 1 and r.inflight == 0
    r.apply_scrape(r.begin_scrape(), running=0, waiting=0, kv_usage=0.0)
    assert r.load == 0


def test_cache_aware_hit_miss_threshold() -> None:
    p = make_policy(RouterConfig(policy="cache-aware", cache_threshold=0.5))
    assert isinstance(p, CacheAware)
    a, b = replica("a", running=4), replica("b")
    system = "You are a careful assistant. " * 10  # 290 characters
    first = p.choose(chat(system + "Question one?"), [a, b])
    assert first.replica is b and first.reason == "cache_miss"  # nothing recorded: least loaded
    b.running = 6  # now busier than a, but well within the balance thresholds
    second = p.choose(chat(system + "Another question?"), [a, b])
    assert second.replica is b and second.reason == "cache_hit" and second.match_ratio > 0.9
    # A prompt sharing less than half with what b was sent goes to the least loaded.
    third = p.choose(chat("Completely different. " + system[:60]), [a, b])
    assert third.replica is a and third.reason == "cache_miss" and third.match_ratio < 0.5
    # The hit must be among the candidates: with b excluded (e.g. already tried), no hit.
    fourth = p.choose(chat(system + "Question one?"), [a])
    assert fourth.replica is a and fourth.reason == "cache_miss"


def test_cache_aware_balance_fallback_needs_both_thresholds() -> None:
    p = make_policy(RouterConfig(policy="cache-aware", balance_abs_threshold=32, balance_rel_threshold=1.5))
    a, b = replica("a"), replica("b", running=1)
    prompt = "shared prefix " * 20
    assert p.choose(chat(prompt), [a, b]).replica is a
    a.running, b.running = 100, 10  # 90 > 32 and 100 > 15: imbalanced
    d = p.choose(chat(prompt + "more"), [a, b])
    assert d.replica is b and d.reason == "balance_fallback"
    p.forget(b.url)  # so that only a holds the prefix below
    a.running, b.running = 200, 150  # 50 > 32 but 200 < 225: balanced enough, the cache wins
    d = p.choose(chat(prompt + "again"), [a, b])
    assert d.replica is a and d.reason == "cache_hit"
    a.running, b.running = 30, 0  # relative yes, absolute no
    assert p.choose(chat(prompt + "and again"), [a, b]).reason == "cache_hit"


def test_cache_aware_forget() -> None:
    p = make_policy(RouterConfig(policy="cache-aware"))
    a, b = replica("a"), replica("b", running=1)
    prompt = "long shared prefix " * 10
    assert p.choose(chat(prompt), [a, b]).replica is a
    p.forget(a.url)
    d = p.choose(chat(prompt), [a, b])
    assert d.reason == "cache_miss"


def test_length_pools() -> None:
    p = make_policy(RouterConfig(policy="length", long_prompt_tokens=100))
    assert isinstance(p, Length)
    long1, long2 = replica("l1", running=2, tags={"tag": "long"}), replica("l2", tags={"tag": "long"})
    short = replica("s", running=9)
    d = p.choose(chat("x" * 401), [long1, long2, short])  # ~101 tokens
    assert d.replica is long2 and d.reason == "long_pool"
    d = p.choose(chat("x" * 40), [long1, long2, short])
    assert d.replica is short and d.reason == "short_pool"
    d = p.choose(route_request("completions", {"prompt": list(range(101))}), [long1, short])
    assert d.replica is long1 and d.reason == "long_pool"  # token ids: counted exactly
    d = p.choose(chat("x" * 40), [long1, long2])  # no short replica available: any will do
    assert d.reason == "pool_fallback" and d.replica is long2


def test_route_request_facts() -> None:
    r = route_request(
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}],
                },
            ],
        },
    )
    assert r.model == "m" and r.text == "system\x1fBe brief.\x1euser\x1fHi" and r.est_tokens == 6
    assert chat_text("not a list") == ""
    assert completion_text("abcdefgh") == ("abcdefgh", 2)
    assert completion_text([1, 2]) == ("1,2,", 2)
    assert not completion_text([1, 23])[0].startswith(completion_text([1, 2])[0])
    assert completion_text(["ab", "cd"]) == ("ab\x1ecd", 2)
    assert completion_text([[1], [2, 3]]) == ("1,\x1e2,3,", 3)
    empty = route_request("completions", None)
    assert (empty.model, empty.text, empty.est_tokens) == (None, "", 0)
    other = route_request("tokenize", {"model": "", "prompt": "x"})
    assert (other.model, other.text, other.est_tokens) == (None, "", 0)
    batch = route_request("completions", {"prompt": [[1, 2, 3], "abcdefgh"]})
    assert batch.est_tokens == 5 and batch.text == "1,2,3,\x1eabcdefgh"


def test_one_conversation_is_one_key_whichever_chat_shaped_api_sends_it() -> None:
    chat = route_request(
        "chat", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    )
    responses = route_request("responses", {"instructions": "Be brief.", "input": "Hi"})
    items = route_request(
        "responses",
        {
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        },
    )
    messages = route_request(
        "messages",
        {"system": [{"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert chat.text == responses.text == items.text == messages.text == "system\x1fBe brief.\x1euser\x1fHi"
    assert route_request("responses", {"input": 5}).text == ""
