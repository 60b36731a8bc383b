"""Forwarding one request: choose a replica, send, retry on another one until the commit
point, answer.

Failed attempts, and what each does to the replica:
- no connection, or the connection breaks before the commit point, or a 5xx other than
  501/503/505: a fault — the replica is ejected at once (health checks re-admit it);
- 503: the replica is not ready (loading, draining) — skipped until a good health check,
  but not a fault;
- 429: the replica is busy — nothing happens to it.
Each moves the request to a replica it has not tried yet (one it has, if none is left and
the earlier one is still in rotation: a 429 may clear), after a backoff of
base * 2**(retry-1), capped, times a random factor in [0.5, 1] (so a burst of retries
spreads out), for at most --max-attempts attempts in all. When they run out the client
gets the last replica's answer as it was (a 429 keeps its Retry-After), or a 502 envelope
if the last attempt got no answer at all. Any other 4xx is the client's: it is passed on
unchanged and never counts against the replica.

The request body was read once (bounded) and is replayed to each replica as bytes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from starlette.responses import Response

from fornax.router.config import RouterConfig
from fornax.router.metrics import NO_REPLICA, RouterMetrics
from fornax.router.policies import Decision, Policy, Rotor, least_loaded
from fornax.router.prompt import RouteRequest
from fornax.router.replicas import EJECT_PASSIVE, Replica, ReplicaSet
from fornax.router.stream import NotOpened, Opened, RelayResponse, Upstream, format_of, open_stream, relay
from fornax.router.upstream import ClientError, send
from fornax.server.errors import ApiError

logger = logging.getLogger("fornax.router")
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# accept-encoding: replicas must answer uncompressed, or SSE events could not be found in the bytes.
# expect: the router has the whole body already; a replica must not answer 100 Continue.
DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}
# The endpoints the policy routes; others go to the least loaded.
GENERATION = ("chat", "completions", "responses", "messages")


def backoff_delay(retry: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before the `retry`-th retry (1-based): in [d/2, d] for
    d = min(cap, base * 2**(retry-1))."""
    ceiling = min(cap, base * 2.0 ** (retry - 1))
    return ceiling * (0.5 + 0.5 * (rng or random).random())


@dataclass
class Failure:
    """A failed attempt; status/headers/content: the replica's answer, if it gave one."""

    kind: str  # transport_error, server_error, not_ready, rate_limited, not_here
    replica: Replica
    message: str
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes = b""


@dataclass
class Attempt:
    """What every attempt of one request shares."""

    endpoint: str
    path: str
    body: bytes
    headers: dict[str, str]
    started: float  # perf_counter at arrival
    number: int = 0
    method: str = "POST"
    # A stored response's id is named (GET/DELETE /v1/responses/{id}, previous_response_id): it
    # lives on the replica that made it, so a 404 sends the request on to the next replica.
    seeks_stored: bool = False


class Lease:
    """One attempt's place in a replica's in-flight count, given back exactly once."""

    __slots__ = ("epoch", "held", "replica")

    def __init__(self, replica: Replica) -> None:
        self.replica, self.epoch, self.held = replica, replica.begin_request(), True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.replica.end_request(self.epoch)


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        replicas: ReplicaSet,
        policy: Policy,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
    ) -> None:
        self.config, self.replicas, self.policy = config, replicas, policy
        self.session, self.metrics = session, metrics
        self._rotor = Rotor()

    # -- the attempt loop --
    async def forward(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        route: RouteRequest,
        headers: dict[str, str],
        method: str = "POST",
        seeks_stored: bool = False,
    ) -> Response:
        ctx = Attempt(
            endpoint, path, body, headers, time.perf_counter(), method=method, seeks_stored=seeks_stored
        )
        self.check_model(route.model)
        tried: set[str] = set()
        failure: Failure | None = None
        # Seeking a stored response may ask every replica once, beyond the retry budget.
        attempts = max(self.config.max_attempts, len(self.replicas.members()) if seeks_stored else 0)
        for number in range(1, attempts + 1):
            if failure is not None and failure.kind == "not_here":
                if all(r.url in tried for r in self.candidates(route.model, tried)):
                    break  # every replica said it does not have it: the last 404 is the answer
            elif failure is not None:
                cfg = self.config
                await asyncio.sleep(backoff_delay(number - 1, cfg.backoff_base_s, cfg.backoff_max_s))
            decision = self.decide(route, tried)
            if decision is None:
                break
            if failure is not None:
                self.metrics.retries.labels(failure.kind).inc()
            tried.add(decision.replica.url)
            ctx.number = number
            result = await self.attempt(decision, ctx)
            if not isinstance(result, Failure):
                return result
            failure = result
        return self.give_up(failure, ctx)

    def check_model(self, model: str | None) -> None:
        """404 for a model no replica serves. A replica whose models are not known (its
        /v1/models needs a key the router lacks) may serve any, if it is in rotation; with
        nothing learned yet there is no telling, and the request goes on (to a 503)."""
        members = self.replicas.members()
        names = sorted({m for r in members for m in (r.models or ())})
        if (
            model is None
            or model in names
            or not names
            or any(r.models is None and r.available for r in members)
        ):
            return
        raise ApiError(
            404,
            f"The model '{model}' does not exist; the replicas serve {', '.join(names)}",
            param="model",
            code="model_not_found",
        )

    def candidates(self, model: str | None, exclude: set[str]) -> list[Replica]:
        """Replicas in rotation serving `model`, untried ones if any are left."""
        able = [r for r in self.replicas.members() if r.available and r.serves(model)]
        fresh = [r for r in able if r.url not in exclude]
        return fresh or able

    def decide(self, route: RouteRequest, tried: set[str]) -> Decision | None:
        candidates = self.candidates(route.model, tried)
        if not candidates:
            return None
        if route.endpoint in GENERATION:
            decision, policy = self.policy.choose(route, candidates), self.policy.name
        else:
            decision, policy = Decision(least_loaded(candidates, self._rotor), "least_load"), "any"
        self.metrics.decisions.labels(policy, decision.reason).inc()
        if decision.match_ratio is not None:
            self.metrics.match_ratio.observe(decision.match_ratio)
        return decision

    # -- one attempt --
    async def attempt(self, decision: Decision, ctx: Attempt) -> Response | Failure:
        replica = decision.replica
        lease, resp, handed_off = Lease(replica), None, False
        try:
            resp = await send(self.session, ctx.method, replica.url, ctx.path, ctx.body, ctx.headers)
            failure = await self._status_failure(resp, replica, ctx)
            if failure is not None:
                return failure
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                opened = await open_stream(resp, format_of(ctx.endpoint))
                if isinstance(opened, NotOpened):
                    return self._not_opened(opened, replica)
                handed_off = True
                return self._stream(opened, resp, lease, decision, ctx)
            content = await resp.read()
            self._finish(replica.url, resp.status, ctx)
            return Response(content, resp.status, self._headers(resp.headers, decision, ctx))
        except ClientError as exc:  # no connection, a broken one, silence past --read-timeout
            return self._fault(replica, "transport_error", f"{type(exc).__name__}: {exc}")
        finally:
            if not handed_off:
                lease.release()
                if resp is not None:
                    resp.release()  # read to its end: the connection is kept; else it is closed

    async def _status_failure(
        self, resp: aiohttp.ClientResponse, replica: Replica, ctx: Attempt
    ) -> Failure | None:
        status = resp.status
        seeking = ctx.seeks_stored and status == 404
        if status != 429 and (status < 500 or status in (501, 505)) and not seeking:
            return None  # success, or the client's error (501/505: the same answer everywhere)
        content = await resp.read()
        failure = Failure("", replica, f"answered {status}", status, dict(resp.headers), content)
        if seeking:
            failure.kind = "not_here"
        elif status == 429:
            failure.kind = "rate_limited"
        elif status == 503:
            failure.kind = "not_ready"
            replica.ready, replica.last_error = False, "not ready (answered 503)"
        else:
            failure.kind = "server_error"
            self.eject(replica, f"answered {status}")
        return failure

    def _not_opened(self, opened: NotOpened, replica: Replica) -> Failure:
        if opened.kind == "not_ready":
            replica.ready, replica.last_error = False, f"not ready ({opened.message})"
            return Failure("not_ready", replica, opened.message)
        return self._fault(replica, opened.kind, opened.message)

    def _fault(self, replica: Replica, kind: str, message: str) -> Failure:
        self.eject(replica, message)
        return Failure(kind, replica, message)

    def eject(self, replica: Replica, why: str) -> None:
        replica.last_error = why
        if replica.health.eject():
            self.metrics.ejections.labels(replica.url, EJECT_PASSIVE).inc()
            logger.warning("replica %s is out of rotation: %s", replica.url, why)

    def _stream(
        self, opened: Opened, resp: aiohttp.ClientResponse, lease: Lease, decision: Decision, ctx: Attempt
    ) -> Response:
        replica = decision.replica

        def on_end(outcome: str) -> None:
            lease.release()
            self.metrics.requests.labels(replica.url, outcome).inc()
            self.metrics.latency.labels(ctx.endpoint).observe(time.perf_counter() - ctx.started)

        upstream = Upstream(resp, on_end)
        body = relay(
            opened,
            upstream,
            lambda why: self.eject(replica, f"failed mid-stream: {why}"),
            format_of(ctx.endpoint),
        )
        return RelayResponse(body, upstream, resp.status, self._headers(resp.headers, decision, ctx))

    # -- answers --
    def give_up(self, failure: Failure | None, ctx: Attempt) -> Response:
        if failure is None:
            self._finish(NO_REPLICA, 503, ctx)
            return ApiError(
                503,
                "no replica is available for this request",
                code="no_healthy_replica",
                headers={"Retry-After": "1"},
            ).response(ctx.path)
        url = failure.replica.url
        headers = {
            "x-fornax-replica": url,
            "x-fornax-route-reason": "retries_exhausted",
            "x-fornax-attempts": str(ctx.number),
        }
        if failure.status is None:
            self._finish(url, 502, ctx)
            message = (
                f"no replica could answer after {ctx.number} attempt(s); the last ({url}): {failure.message}"
            )
            return ApiError(
                502, message, type="server_error", code="replica_unavailable", headers=headers
            ).response(ctx.path)
        self._finish(url, failure.status, ctx)
        kept = {k: v for k, v in failure.headers.items() if k.lower() not in DROP_RESPONSE}
        return Response(failure.content, failure.status, {**kept, **headers})

    def _finish(self, replica: str, status: int, ctx: Attempt) -> None:
        self.metrics.requests.labels(replica, outcome_of(status)).inc()
        self.metrics.latency.labels(ctx.endpoint).observe(time.perf_counter() - ctx.started)

    @staticmethod
    def _headers(upstream: Mapping[str, str], decision: Decision, ctx: Attempt) -> dict[str, str]:
        out = {k: v for k, v in upstream.items() if k.lower() not in DROP_RESPONSE}
        out["x-fornax-replica"] = decision.replica.url
        out["x-fornax-route-reason"] = decision.reason
        out["x-fornax-attempts"] = str(ctx.number)
        return out


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "error"


def upstream_headers(client_headers: Mapping[str, str], replica_key: str | None) -> dict[str, str]:
    """The client's headers as a replica gets them: hop-by-hop ones dropped, and the client's
    key (Authorization or x-api-key) replaced by the replica key when the router has one."""
    out = {k: v for k, v in client_headers.items() if k.lower() not in DROP_REQUEST}
    if replica_key is not None:  # the client's key, in either header Anthropic's and OpenAI's clients use
        out = {k: v for k, v in out.items() if k.lower() not in ("authorization", "x-api-key")}
        out["authorization"] = f"Bearer {replica_key}"
    return out
