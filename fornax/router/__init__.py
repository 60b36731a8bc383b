"""`fornax router`: one OpenAI-compatible front door over several fornax replicas.

Topology
    clients ──HTTP──▶ router ──HTTP (one aiohttp session, kept-alive)──▶ replica 1..N (`fornax serve`)
The router speaks HTTP only (no engine, no torch): /v1/chat/completions, /v1/completions,
/tokenize and /detokenize are relayed (streams chunk by chunk, as they arrive); /v1/models
is the union of the replicas' models; /health is 200 while any replica is in rotation;
/metrics has the router's own `fornax_router:*` series; /router/replicas lets an
orchestrator list, add and remove replicas (admin key). Replicas come from --replica URLs,
from --replica-dns names re-resolved every poll, from the admin routes, or in-process from
a `ReplicaSet` (add / remove / urls, callable from any thread). Every relayed answer
carries `x-fornax-replica` (who answered), `x-fornax-route-reason` (why) and
`x-fornax-attempts`. `fornax router` imports neither torch nor the model modules (about
0.1 s to parse its flags, ~57 MB resident when serving); `python -m fornax.router` is the same.

Load
    load(replica) = running + waiting (its fornax:num_requests_running / _waiting, polled
    from /metrics every --poll-interval) + the requests this router sent it since that
    scrape was taken and that are still in flight (which the scrape cannot have counted).
Before a replica's first scrape (or if /metrics needs a key the router lacks) this is
just the router's in-flight count on it. Ties go by KV-cache usage, then in-flight count,
then in turn. Requests running/waiting count sequences: a request with n=4 counts 4.

Keys to replicas
    Polls (/health, /metrics, /v1/models) present --replica-poll-key (a replica admin key,
    say), else --replica-api-key. Relayed requests present --replica-api-key if given, else
    the client's own Authorization unchanged, so each replica still knows whose request it
    is (its per-key usage, rate limits and prefix-cache scope).

Policies (--policy; fornax/router/policies.py, a Protocol and a registry)
    cache-aware (default)  a radix tree of the prompts sent to each replica (one tree, each
        node knowing which replicas were sent it; LRU-evicted under --cache-max-chars). If
        the replica with the longest recorded prefix covers >= --cache-threshold of the
        prompt, it gets the request ("cache_hit"), else the least loaded ("cache_miss").
        While the busiest replica's load exceeds the idlest's by more than
        --balance-abs-threshold and by more than --balance-rel-threshold times, the least
        loaded gets it regardless ("balance_fallback").
    least-load   the least loaded ("least_load").
    round-robin  in turn ("round_robin").
    length       prompts over --long-prompt-tokens (estimated as characters / 4, exact for
        token ids) to replicas tagged --long-pool-tag (default tag=long, e.g.
        --replica http://h:8000#tag=long), the others to the untagged ones ("long_pool",
        "short_pool"); any replica if that pool has none available ("pool_fallback").
Every policy first narrows the candidates to replicas in rotation serving the request's
`model` (learned from each replica's /v1/models); a model no replica serves is a 404
`model_not_found`.

Health
    Active: /health every poll. 200 is good, 503 is "not ready" (loading, draining: skipped,
    not a failure), anything else or no answer is a failure. --unhealthy-after (3)
    consecutive failures take a replica out; --healthy-after (2) consecutive good checks
    bring it back (a new replica enters on its first good check).
    Passive: a connection error or a 5xx (but 501/503/505) on a relayed request takes the
    replica out at once; active checks bring it back. A 4xx is the client's fault and never
    counts against a replica; a 503 marks it not ready until its next good check.

Failover (fornax/router/proxy.py, stream.py)
    A request whose replica fails before the commit point (connection error, 5xx, 503, 429,
    an error event before any content) is retried on another replica, for at most
    --max-attempts attempts, after an exponential backoff with jitter (--backoff-base 50 ms,
    doubling, capped by --backoff-max). The commit point of a stream is its first event
    with content (a chat stream's role-only opening chunk is held back until then), so a
    request queued on a replica that dies still fails over. After it, a failing replica
    ends the stream with an OpenAI error event and `data: [DONE]`; only whole events are
    ever relayed, so no chunk claims a finish_reason its replica did not send. When every
    attempt got a 429 the client gets the last one (with its Retry-After). The body is read
    once (bounded by --max-body-bytes) and replayed.
"""

from __future__ import annotations

from fornax.router.config import RouterConfig
from fornax.router.replicas import Replica, ReplicaSet

__all__ = ["Replica", "ReplicaSet", "RouterConfig"]
