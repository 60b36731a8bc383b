"""Soak: thousands of mixed requests through one `fornax serve`, with clients that vanish at
random moments and bodies that are broken, then proof that nothing leaked.

The mix: chat and completions, streaming and not, short outputs (8-48 tokens by default, so
a run ends in reasonable time on a 2-core machine), now and then n=2, two prompts in one
completions request, logprobs, echo or a stop string. Of all requests, --disconnect-fraction
are cut by the client (its asyncio task is cancelled, which closes the connection) at a
random moment: before the answer's headers, mid-stream after some events, or mid-generation
of a non-streaming answer; --malformed-fraction carry a broken body (bad JSON, wrong types,
NaN, huge numbers, an unknown model, empty messages...), each of which must get a 4xx error
envelope.

Goals (exit status 1 if any is missed):
  - 0 KV blocks leaked: once idle, /admin/state reports kv_cache_usage 0 and kv_integrity "ok";
  - 0 hung streams: every request ends within --timeout, and the server ends idle (no request
    in flight, no engine stream);
  - 0 answers with a 5xx status, as the clients saw them and as the server counted them
    (/metrics: a 500 answered to a client already gone is seen by nobody else);
  - every well-formed request answered in full (finish_reason on every choice, a stream's
    `data: [DONE]`), every malformed one refused with a 4xx envelope;
  - the server's RSS grows < 5% between the end of the first 1,000 requests and the end of
    the last 1,000 (measured when the script starts the server, or is given --pid);
  - a server this script started exits 0 on SIGTERM.

The KV pool (1 GiB by default) is an anonymous mapping: its pages become resident when first
written, and the block pool hands out every free block once before it reuses one (freed
blocks join the tail of its queue). So, untouched, RSS rises by up to the pool's size over
the first few thousand requests, a one-time cost that says nothing about leaks (measured
without the warm-up: +1,042 MiB by request 2,000 of 5,000, then +2 MiB over the last 3,000).
Before the measured run the soak therefore writes the whole pool once (--no-kv-warmup skips
it; ~1 minute on the 2-core dev machine): unique prompts, 1 output token each, 1.25x the
pool's tokens in all (from /v1/fornax/live). The report gives RSS before and after it too.

By default it starts its own `fornax serve` on a free loopback port with make run's flags
(--quantization auto --large-step-quantization w8a8) and no keys, so /admin/state is open.
Not run in CI (tests/server/test_soak.py runs a shortened soak through run_soak()).

    python benchmarks/soak.py                       # 5,000 requests at concurrency 32
    python benchmarks/soak.py --requests 2000 --server-log /tmp/soak-server.log
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 12345 --admin-key sk-admin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__:  # imported as benchmarks.soak (tests/server/test_soak.py)
    from benchmarks._servers import MAKE_RUN_FLAGS, FornaxProcess
else:  # run as a script: benchmarks/ is on sys.path
    from _servers import MAKE_RUN_FLAGS, FornaxProcess

DEFAULT_MODEL = "smollm2-135m-instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FINISH_REASONS = frozenset({"stop", "length"})
RSS_GROWTH_LIMIT = 0.05

# Outcomes of one request.
COMPLETED = "completed"  # a well-formed request answered in full
DISCONNECTED = "disconnected"  # cut by the client as planned, before its answer ended
REJECTED = "rejected"  # a malformed request refused with a 4xx error envelope
FAILED = "failed"  # anything else: a wrong status, a cut or broken answer, a transport error
HUNG = "hung"  # no end within the per-request timeout
OUTCOMES = (COMPLETED, DISCONNECTED, REJECTED, FAILED, HUNG)


# ---- the plan of a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request of the run, decided up front from the seed (so a run can be repeated)."""

    index: int
    kind: str  # "normal" | "disconnect" | "malformed"
    path: str
    stream: bool
    body: bytes
    label: str  # the malformed variant, or the endpoint and mode
    num_choices: int = 1  # choices a complete answer carries (prompts x n)
    max_tokens: int = 0
    cut_after_s: float | None = None  # disconnect: cancel after this long...
    cut_after_events: int | None = None  # ...or once this many SSE events have arrived


_TOPICS = (
    "the sea",
    "a compiler",
    "autumn",
    "the moon",
    "bread",
    "a violin",
    "rain",
    "chess",
    "a lighthouse",
    "glaciers",
    "bees",
    "a train station",
    "tea",
    "volcanoes",
    "a library",
    "the wind",
)
_ASKS = (
    "Write a short note about",
    "Describe",
    "Explain in simple words",
    "List three facts about",
    "Tell a tiny story about",
    "Summarize what you know about",
)
_FILLER = [
    "please",
    "keep",
    "it",
    "brief",
    "and",
    "clear",
    "for",
    "a",
    "curious",
    "reader",
    "who",
    "has",
    "little",
    "time",
    "today",
]


def _prompt(rng: random.Random) -> str:
    """A short prompt; a few recur exactly, so prefix-cache hits (shared blocks) are exercised."""
    text = f"{rng.choice(_ASKS)} {rng.choice(_TOPICS)}."
    if rng.random() < 0.6:
        text += " " + " ".join(rng.choice(_FILLER) for _ in range(rng.randint(1, 40)))
    return text


def _well_formed(rng: random.Random, model: str, max_tokens: tuple[int, int]) -> dict[str, Any]:
    """Fields of one valid request: path, stream, body (a dict), num_choices, max_tokens."""
    path = rng.choice((CHAT, COMPLETIONS))
    stream = rng.random() < 0.5
    budget = rng.randint(*max_tokens)
    n = 2 if rng.random() < 0.1 else 1
    body: dict[str, Any] = {"model": model, "max_tokens": budget, "stream": stream}
    body["temperature"] = rng.choice((0.0, 0.8))
    if body["temperature"] and rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if n > 1:
        body["n"] = n
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["stop"] = ["\n\n", "."]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    num_prompts = 1
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.2:
            body["messages"].insert(0, {"role": "system", "content": "You are a concise assistant."})
        if rng.random() < 0.1:
            body["logprobs"], body["top_logprobs"] = True, 2
    else:
        if rng.random() < 0.1:
            body["prompt"], num_prompts = [_prompt(rng), _prompt(rng)], 2
        else:
            body["prompt"] = _prompt(rng)
        if rng.random() < 0.1:
            body["logprobs"] = 2
        if rng.random() < 0.05:
            body["echo"] = True
    return {
        "path": path,
        "stream": stream,
        "body": body,
        "num_choices": n * num_prompts,
        "max_tokens": budget,
    }


def _json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}


def _completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hi", "max_tokens": 8, **fields}


# Broken bodies: (name, path, body builder). Each must be answered 4xx with an error envelope.
# Written as raw bytes where json.dumps could not produce them (NaN, overflow, bad UTF-8).
MALFORMED: tuple[tuple[str, str, Callable[[str], bytes]], ...] = (
    (
        "truncated_json",
        CHAT,
        lambda m: b'{"model": "%s", "messages": [{"role": "user", "content": "hi"' % m.encode(),
    ),
    ("not_an_object", CHAT, lambda m: b"[1, 2, 3]"),
    ("empty_body", COMPLETIONS, lambda m: b""),
    ("invalid_utf8", COMPLETIONS, lambda m: b'{"model": "\xff\xfe", "prompt": "hi"}'),
    (
        "nan_temperature",
        COMPLETIONS,
        lambda m: b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % m.encode(),
    ),
    ("infinite_top_p", CHAT, lambda m: _json_bytes(_chat(m))[:-1] + b', "top_p": Infinity}'),
    ("float_overflow", COMPLETIONS, lambda m: _json_bytes(_completion(m))[:-1] + b', "temperature": 1e999}'),
    ("huge_max_tokens", COMPLETIONS, lambda m: _json_bytes(_completion(m, max_tokens=10**30))),
    ("huge_n", CHAT, lambda m: _json_bytes(_chat(m, n=10**20))),
    ("huge_seed", COMPLETIONS, lambda m: _json_bytes(_completion(m, seed=10**40, temperature=0.8))),
    ("negative_max_tokens", CHAT, lambda m: _json_bytes(_chat(m, max_tokens=-5))),
    ("max_tokens_string", COMPLETIONS, lambda m: _json_bytes(_completion(m, max_tokens="many"))),
    ("messages_string", CHAT, lambda m: _json_bytes({"model": m, "messages": "hello"})),
    ("messages_null", CHAT, lambda m: _json_bytes({"model": m, "messages": None})),
    ("prompt_object", COMPLETIONS, lambda m: _json_bytes({"model": m, "prompt": {"text": "hi"}})),
    ("unknown_model", CHAT, lambda m: _json_bytes(_chat("no-such-model"))),
    ("empty_messages", CHAT, lambda m: _json_bytes({"model": m, "messages": []})),
    ("empty_prompt_list", COMPLETIONS, lambda m: _json_bytes({"model": m, "prompt": []})),
    (
        "unknown_role",
        CHAT,
        lambda m: _json_bytes({"model": m, "messages": [{"role": "wizard", "content": "hi"}]}),
    ),
    (
        "token_out_of_range",
        COMPLETIONS,
        lambda m: _json_bytes({"model": m, "prompt": [10**9], "max_tokens": 4}),
    ),
    ("n_zero", COMPLETIONS, lambda m: _json_bytes(_completion(m, n=0))),
    ("negative_temperature", CHAT, lambda m: _json_bytes(_chat(m, temperature=-1.0))),
    ("stop_number", COMPLETIONS, lambda m: _json_bytes(_completion(m, stop=5))),
    ("logit_bias_bad_key", CHAT, lambda m: _json_bytes(_chat(m, logit_bias={"abc": 1.0}))),
    ("top_logprobs_alone", CHAT, lambda m: _json_bytes(_chat(m, top_logprobs=3))),
    (
        "stream_options_no_stream",
        COMPLETIONS,
        lambda m: _json_bytes(_completion(m, stream_options={"include_usage": True})),
    ),
    (
        "deep_nesting",
        COMPLETIONS,
        lambda m: b'{"model": "%s", "prompt": %s%s}' % (m.encode(), b"[" * 20000, b"]" * 20000),
    ),
)


def make_plans(
    requests: int,
    model: str,
    *,
    disconnect_fraction: float,
    malformed_fraction: float,
    max_tokens: tuple[int, int],
    seed: int,
) -> list[Plan]:
    """`requests` plans; exactly round(fraction x requests) disconnects and malformed bodies,
    at random positions."""
    rng = random.Random(seed)
    num_cut = round(requests * disconnect_fraction)
    num_bad = min(round(requests * malformed_fraction), requests - num_cut)
    kinds = ["disconnect"] * num_cut + ["malformed"] * num_bad + ["normal"] * (requests - num_cut - num_bad)
    rng.shuffle(kinds)
    plans, num_malformed = [], 0
    for i, kind in enumerate(kinds):
        if kind == "malformed":  # in turn, so any run with enough of them sends every variant
            plans.append(malformed_plan(i, num_malformed % len(MALFORMED), model))
            num_malformed += 1
        else:
            plans.append(_plan(i, kind, rng, model, max_tokens))
    return plans


def malformed_plan(index: int, variant: int, model: str) -> Plan:
    name, path, build = MALFORMED[variant]
    return Plan(index, "malformed", path, False, build(model), name)


def _plan(index: int, kind: str, rng: random.Random, model: str, max_tokens: tuple[int, int]) -> Plan:
    spec = _well_formed(rng, model, max_tokens)
    label = ("chat" if spec["path"] == CHAT else "completions") + (" stream" if spec["stream"] else "")
    plan = Plan(
        index,
        kind,
        spec["path"],
        spec["stream"],
        _json_bytes(spec["body"]),
        label,
        spec["num_choices"],
        spec["max_tokens"],
    )
    if kind != "disconnect":
        return plan
    # The moment of the cut: at once (usually before the answer's headers), after a while
    # (queued, in prefill, or mid-generation), or, for a stream, after some of its events.
    # Short enough that most cuts land before the answer ends (a short answer takes well
    # under a second at this concurrency); one that lands later is judged as an answer.
    moment = rng.random()
    if moment < 0.25:
        return _with_cut(plan, after_s=rng.uniform(0.0, 0.05))
    if moment < 0.6 or not plan.stream:
        return _with_cut(plan, after_s=rng.uniform(0.05, 0.8))
    return _with_cut(plan, after_events=rng.randint(1, max(1, plan.max_tokens // 2)))


def _with_cut(plan: Plan, after_s: float | None = None, after_events: int | None = None) -> Plan:
    return Plan(
        plan.index,
        plan.kind,
        plan.path,
        plan.stream,
        plan.body,
        plan.label,
        plan.num_choices,
        plan.max_tokens,
        after_s,
        after_events,
    )


# ---- one request ------------------------------------------------------------------------------------


@dataclass
class Result:
    plan: Plan
    outcome: str
    status: int | None = None  # the HTTP status, if headers arrived
    detail: str = ""
    phase: str = ""  # a disconnect's: "before_headers" or "mid_body"


@dataclass
class Progress:
    """What a request has seen so far; a disconnect's controller reads it."""

    cut_after_events: int | None = None
    headers: bool = False
    events: int = 0
    reached: asyncio.Event = field(default_factory=asyncio.Event)

    def saw_event(self) -> None:
        self.events += 1
        if self.cut_after_events is not None and self.events >= self.cut_after_events:
            self.reached.set()


def _is_envelope(raw: bytes) -> bool:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    fields = {"message", "type", "param", "code"}
    return isinstance(error, dict) and fields <= error.keys() and bool(error["message"])


async def _exchange(
    client: httpx.AsyncClient, plan: Plan, headers: dict[str, str], progress: Progress
) -> Result:
    """Send a well-formed request and judge its answer; never raises but CancelledError."""
    try:
        async with client.stream("POST", plan.path, content=plan.body, headers=headers) as resp:
            progress.headers = True
            if resp.status_code != 200:
                raw = await resp.aread()
                return Result(plan, FAILED, resp.status_code, f"HTTP {resp.status_code}: {raw[:200]!r}")
            if plan.stream:
                outcome, detail = await _judge_stream(plan, resp, progress)
            else:
                outcome, detail = _judge_json(plan, await resp.aread())
            return Result(plan, outcome, resp.status_code, detail)
    except (httpx.HTTPError, OSError) as exc:
        return Result(plan, FAILED, None, f"{type(exc).__name__}: {exc}")


async def _judge_stream(plan: Plan, resp: httpx.Response, progress: Progress) -> tuple[str, str]:
    """Every choice has a finish reason, no event is an error, and `data: [DONE]` ends it."""
    finish: dict[int, str] = {}
    done = False
    async for line in resp.aiter_lines():
        if not line:
            continue
        if done:
            return FAILED, f"data after [DONE]: {line[:120]!r}"
        if not line.startswith("data: "):
            return FAILED, f"not an SSE data line: {line[:120]!r}"
        progress.saw_event()
        if line == "data: [DONE]":
            done = True
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return FAILED, f"an event is not JSON: {line[:120]!r}"
        if "error" in event:
            return FAILED, f"error event: {event['error']}"
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") is not None:
                finish[choice["index"]] = choice["finish_reason"]
    if not done:
        return FAILED, f"the stream ended without [DONE] after {progress.events} events"
    return _judge_finish(plan, finish)


def _judge_json(plan: Plan, raw: bytes) -> tuple[str, str]:
    try:
        answer = json.loads(raw)
        finish = {c["index"]: c["finish_reason"] for c in answer["choices"]}
        completion_tokens = answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError) as exc:
        return FAILED, f"a malformed answer ({type(exc).__name__}): {raw[:200]!r}"
    if completion_tokens > plan.num_choices * plan.max_tokens:
        return FAILED, f"{completion_tokens} completion tokens, over {plan.num_choices} x {plan.max_tokens}"
    return _judge_finish(plan, finish)


def _judge_finish(plan: Plan, finish: dict[int, str]) -> tuple[str, str]:
    expected = set(range(plan.num_choices))
    if finish.keys() != expected or not set(finish.values()) <= FINISH_REASONS:
        return FAILED, f"finish reasons {finish}; choices {sorted(expected)} should each end stop or length"
    return COMPLETED, ""


async def _malformed(client: httpx.AsyncClient, plan: Plan, headers: dict[str, str]) -> Result:
    try:
        resp = await client.post(plan.path, content=plan.body, headers=headers)
    except (httpx.HTTPError, OSError) as exc:
        return Result(plan, FAILED, None, f"{plan.label}: {type(exc).__name__}: {exc}")
    if 400 <= resp.status_code < 500 and _is_envelope(resp.content):
        return Result(plan, REJECTED, resp.status_code)
    detail = f"{plan.label}: HTTP {resp.status_code}: {resp.content[:200]!r}"
    return Result(plan, FAILED, resp.status_code, detail)


async def _disconnecting(client: httpx.AsyncClient, plan: Plan, headers: dict[str, str]) -> Result:
    """Run the request in a task and cancel it at the planned moment: httpx then closes the
    connection, which is what the server sees of a client that goes away. A request that ends
    before its moment is judged as any other answer."""
    progress = Progress(cut_after_events=plan.cut_after_events)
    task = asyncio.create_task(_exchange(client, plan, headers, progress))
    reached = asyncio.create_task(progress.reached.wait())
    try:
        if plan.cut_after_events is not None:
            await asyncio.wait({task, reached}, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.wait({task}, timeout=plan.cut_after_s)
        if task.done():
            return task.result()
        phase = "mid_body" if progress.headers else "before_headers"
        return Result(plan, DISCONNECTED, None, phase=phase)
    finally:
        reached.cancel()
        if not task.done():  # the planned cut, or the soak's own timeout cancelling this one
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def run_one(client: httpx.AsyncClient, plan: Plan, headers: dict[str, str], timeout_s: float) -> Result:
    """One planned request, bounded by `timeout_s`: past it, the request counts as hung."""
    try:
        async with asyncio.timeout(timeout_s):
            if plan.kind == "malformed":
                return await _malformed(client, plan, headers)
            if plan.kind == "disconnect":
                return await _disconnecting(client, plan, headers)
            return await _exchange(client, plan, headers, Progress())
    except TimeoutError:
        return Result(plan, HUNG, None, f"{plan.label}: no end within {timeout_s:.0f}s")


# ---- the server's memory and state -------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process `pid` (psutil if present, else /proc); None if unreadable."""
    try:
        import psutil  # optional: not a dependency of fornax
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _is_idle(state: dict[str, Any]) -> bool:
    return (
        state.get("num_running") == 0
        and state.get("num_waiting") == 0
        and state.get("kv_cache_usage") == 0
        and state.get("inflight_requests") == 0
        and state.get("engine_streams") == 0
    )


async def wait_idle_state(
    client: httpx.AsyncClient, headers: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Poll /admin/state until the server is idle or `timeout_s` passes; the last state read."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while True:
        try:
            resp = await client.get("/admin/state", headers=headers, timeout=30)
            ok = resp.status_code == 200
            state = resp.json() if ok else {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        except (httpx.HTTPError, ValueError) as exc:
            state = {"error": f"{type(exc).__name__}: {exc}"}
        if _is_idle(state) or time.monotonic() >= deadline:
            return state
        await asyncio.sleep(0.2)


async def server_error_statuses(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[int, int] | None:
    """The server's own count of 4xx/5xx answers by status (fornax:request_errors in /metrics)."""
    try:
        resp = await client.get("/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    counts: dict[int, int] = {}
    for line in resp.text.splitlines():
        match = re.match(r'fornax:request_errors_total\{.*status="(\d+)".*\} ([0-9.e+]+)$', line)
        if match:
            counts[int(match[1])] = counts.get(int(match[1]), 0) + int(float(match[2]))
    return counts


# ---- the report -------------------------------------------------------------------------------------


@dataclass
class SoakReport:
    url: str
    requests: int
    concurrency: int
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    disconnect_phases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # the first few, for the summary
    rss_window: int = 1000
    rss_samples: list[tuple[int, int]] = field(default_factory=list)  # (requests done, bytes)
    rss_start: int | None = None
    rss_warm: int | None = None  # after the KV pool warm-up
    warm_tokens: int = 0  # prompt tokens the warm-up wrote
    warm_s: float = 0.0
    final_state: dict[str, Any] = field(default_factory=dict)
    # The server's count of error answers by status over the run (the end's count less the
    # start's: a server polled while loading has answered 503s before); None: unreadable.
    server_errors_start: dict[int, int] | None = None
    server_errors_end: dict[int, int] | None = None
    wall_s: float = 0.0
    server_exit_code: int | None = None  # set when the soak started (and stopped) the server

    def add(self, result: Result) -> None:
        self.outcomes[result.outcome] += 1
        self.by_kind[(result.plan.kind, result.outcome)] += 1
        if result.status is not None:
            self.statuses[result.status] += 1
        if result.phase:
            self.disconnect_phases[result.phase] += 1
        if result.outcome in (FAILED, HUNG) and len(self.failures) < 20:
            plan = result.plan
            self.failures.append(f"#{plan.index} {plan.kind} {plan.label}: {result.detail}")

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())

    @property
    def num_5xx(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    @property
    def server_errors(self) -> dict[int, int] | None:
        start, end = self.server_errors_start, self.server_errors_end
        if start is None or end is None:
            return None
        return {status: n - start.get(status, 0) for status, n in end.items() if n > start.get(status, 0)}

    @property
    def num_server_5xx(self) -> int:
        return sum(count for status, count in (self.server_errors or {}).items() if status >= 500)

    @property
    def rss_first(self) -> int | None:
        """RSS at the end of the first `rss_window` requests (None if the run was shorter)."""
        return next((b for n, b in self.rss_samples if n == self.rss_window), None)

    @property
    def rss_last(self) -> int | None:
        """RSS at the end of the run, i.e. of the last `rss_window` requests."""
        last = self.rss_samples[-1] if self.rss_samples else None
        return last[1] if last and last[0] == self.requests and self.requests >= 2 * self.rss_window else None

    @property
    def rss_growth(self) -> float | None:
        first, last = self.rss_first, self.rss_last
        return None if first is None or last is None else (last - first) / first

    def goals(self, check_rss: bool = True) -> dict[str, bool]:
        state = self.final_state
        goals = {
            "0 KV blocks leaked": state.get("kv_cache_usage") == 0
            and state.get("kv_integrity") == "ok"
            and state.get("num_running") == 0
            and state.get("num_waiting") == 0,
            "0 hung streams": self.outcomes[HUNG] == 0
            and state.get("inflight_requests") == 0
            and state.get("engine_streams") == 0,
            "0 5xx": self.num_5xx == 0 and self.num_server_5xx == 0,
            "every request answered as it should be": self.done == self.requests
            and self.outcomes[FAILED] == 0,
        }
        if check_rss and self.rss_growth is not None:
            goals[f"RSS growth < {RSS_GROWTH_LIMIT:.0%}"] = self.rss_growth < RSS_GROWTH_LIMIT
        if self.server_exit_code is not None:
            goals["server exit 0 on SIGTERM"] = self.server_exit_code == 0
        return goals

    @property
    def ok(self) -> bool:
        return all(self.goals().values())

    def _warm_text(self) -> str:
        if not self.warm_tokens:
            return ""
        return f"after the KV warm-up {_mib(self.rss_warm)} ({self.warm_tokens} prompt tokens, {self.warm_s:.0f} s), "

    def summary(self) -> str:
        mib = _mib
        o, p = self.outcomes, self.disconnect_phases
        state = self.final_state
        lines = [
            f"soak: {self.requests} requests at concurrency {self.concurrency} against {self.url}",
            f"  outcomes    completed {o[COMPLETED]}, disconnected {o[DISCONNECTED]} (before headers "
            f"{p['before_headers']}, mid-body {p['mid_body']}), rejected 4xx {o[REJECTED]}, failed {o[FAILED]}, "
            f"hung {o[HUNG]}",
            "  by kind     " + ", ".join(f"{k}/{out} {n}" for (k, out), n in sorted(self.by_kind.items())),
            "  statuses    "
            + ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
            + f"  (5xx: {self.num_5xx}); the server's count of errors: {_statuses(self.server_errors)}",
            f"  RSS         start {mib(self.rss_start)}, {self._warm_text()}end of first {self.rss_window} "
            f"{mib(self.rss_first)}, "
            f"end of last {self.rss_window} {mib(self.rss_last)}, growth {_pct(self.rss_growth)}",
            f"  server      kv_cache_usage {state.get('kv_cache_usage')}, kv_integrity {state.get('kv_integrity')}, "
            f"inflight {state.get('inflight_requests')}, engine_streams {state.get('engine_streams')}, "
            f"running {state.get('num_running')}, waiting {state.get('num_waiting')}, "
            f"aborted {state.get('aborted_requests')}"
            + (f", error {state['error']}" if "error" in state else ""),
            f"  wall        {self.wall_s:.1f} s, {self.done / self.wall_s if self.wall_s else 0.0:.2f} requests/s",
        ]
        if self.server_exit_code is not None:
            lines.append(f"  exit        the server exited {self.server_exit_code} on SIGTERM")
        lines += [f"  failure     {f}" for f in self.failures[:10]]
        verdicts = (f"{goal}: {'ok' if met else 'MISSED'}" for goal, met in self.goals().items())
        lines.append("  goals       " + "; ".join(verdicts))
        lines.append("soak: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _statuses(counts: dict[int, int] | None) -> str:
    if counts is None:
        return "n/a"
    return ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())) or "none"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2%}"


# ---- the run ----------------------------------------------------------------------------------------


async def _soak(
    url: str,
    plans: list[Plan],
    concurrency: int,
    report: SoakReport,
    *,
    pid: int | None,
    headers: dict[str, str],
    admin_headers: dict[str, str],
    timeout_s: float,
    progress_every: int,
    warm_kv: bool,
    model: str,
) -> None:
    # Room for every worker's connection plus those a cancelled request leaves closing.
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s + 10, connect=30)  # asyncio's bound below decides "hung"
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        report.rss_start = rss_bytes(pid) if pid else None
        report.server_errors_start = await server_error_statuses(client, admin_headers)
        if warm_kv:
            warm_start = time.monotonic()
            report.warm_tokens = await warm_kv_pool(client, headers, model)
            report.warm_s = time.monotonic() - warm_start
            report.rss_warm = rss_bytes(pid) if pid else None
            if progress_every:
                print(
                    f"  KV warm-up: {report.warm_tokens} prompt tokens in {report.warm_s:.0f} s, "
                    f"RSS {_mib(report.rss_warm)}",
                    flush=True,
                )
        start = time.monotonic()
        pending = iter(plans)

        async def worker() -> None:
            for plan in pending:  # one shared iterator: each plan goes to exactly one worker
                report.add(await run_one(client, plan, headers, timeout_s))
                _after_each(report, pid, start, progress_every)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.wall_s = time.monotonic() - start
        report.final_state = await wait_idle_state(client, admin_headers, timeout_s=60)
        report.server_errors_end = await server_error_statuses(client, admin_headers)


async def warm_kv_pool(client: httpx.AsyncClient, headers: dict[str, str], model: str) -> int:
    """Write every block of the server's KV pool once (see the module's docstring); the prompt
    tokens sent. Unique prompts of random numbers, so no prefix-cache hit spares a block."""
    try:
        live = (await client.get("/v1/fornax/live", params={"once": "true"}, headers=headers)).json()
        target = int(1.25 * live["num_blocks"] * live["block_size"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return 0  # not a fornax server, or no view of its pool: measure without the warm-up
    rng = random.Random(1234)
    # Short prompts, many at once: a batch of them prefills several times faster per token
    # than a few long ones (whose attention grows with their length).
    written, numbers = 0, 60  # ~300 tokens a prompt; halved if the context is smaller
    for _ in range(100):  # bounded: 1.25 x a 1 GiB pool takes ~12 rounds of 16
        if written >= target:
            break
        bodies = [{"model": model, "max_tokens": 1, "prompt": _numbers(rng, numbers)} for _ in range(16)]
        answers = await asyncio.gather(*(client.post(COMPLETIONS, json=b, headers=headers) for b in bodies))
        for answer in answers:
            if answer.status_code == 200:
                written += answer.json()["usage"]["prompt_tokens"]
            elif answer.status_code == 400 and numbers > 5:
                numbers //= 2  # context_length_exceeded: a server with a short context
    return written


def _numbers(rng: random.Random, count: int) -> str:
    return " ".join(str(rng.randrange(10_000)) for _ in range(count))


def _after_each(report: SoakReport, pid: int | None, start: float, progress_every: int) -> None:
    """RSS at every window's end (the first and the last are the goal's), and a progress line."""
    done = report.done
    if pid and (done % report.rss_window == 0 or done == report.requests):
        rss = rss_bytes(pid)
        if rss is not None:
            report.rss_samples.append((done, rss))
    if progress_every and (done % progress_every == 0 or done == report.requests):
        o = report.outcomes
        rate = done / max(time.monotonic() - start, 1e-9)
        rss = _mib(report.rss_samples[-1][1]) if report.rss_samples else "n/a"
        print(
            f"  {done}/{report.requests}  completed {o[COMPLETED]}  disconnected {o[DISCONNECTED]}  "
            f"rejected {o[REJECTED]}  failed {o[FAILED]}  hung {o[HUNG]}  5xx {report.num_5xx}  "
            f"{rate:.2f} req/s  RSS {rss}",
            flush=True,
        )


def run_soak(
    url: str,
    requests: int = 5000,
    concurrency: int = 32,
    *,
    disconnect_fraction: float = 0.2,
    malformed_fraction: float = 0.05,
    max_tokens: tuple[int, int] = (8, 48),
    pid: int | None = None,
    api_key: str | None = None,
    admin_key: str | None = None,
    model: str = DEFAULT_MODEL,
    timeout_s: float = 120.0,
    seed: int = 0,
    rss_window: int = 1000,
    progress_every: int = 0,
    warm_kv: bool = False,
) -> SoakReport:
    """Drive `requests` planned requests at `concurrency` against the server at `url` (pid: its
    process, for RSS), wait for it to be idle and return the report (its goals unchecked).
    warm_kv: write the whole KV pool once first, so its first touch is not counted as growth."""
    plans = make_plans(
        requests,
        model,
        disconnect_fraction=disconnect_fraction,
        malformed_fraction=malformed_fraction,
        max_tokens=max_tokens,
        seed=seed,
    )
    report = SoakReport(url=url, requests=requests, concurrency=concurrency, rss_window=rss_window)
    headers = _bearer(api_key or admin_key)
    admin_headers = _bearer(admin_key or api_key)
    asyncio.run(
        _soak(
            url,
            plans,
            concurrency,
            report,
            pid=pid,
            headers=headers,
            admin_headers=admin_headers,
            timeout_s=timeout_s,
            progress_every=progress_every,
            warm_kv=warm_kv,
            model=model,
        )
    )
    return report


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---- a server of its own ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running server (default: start one with make run's flags)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    parser.add_argument("--api-key", help="with --url: a key for the generation routes")
    parser.add_argument("--admin-key", help="with --url: a key for /admin/state (and, alone, for requests)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--malformed-fraction", type=float, default=0.05)
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a request counts as hung"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rss-window", type=int, default=1000, help="requests in the first (and last) RSS window"
    )
    parser.add_argument("--progress-every", type=int, default=250)
    parser.add_argument(
        "--no-kv-warmup", action="store_true", help="measure RSS without writing the KV pool first"
    )
    parser.add_argument("--server-log", type=Path, help="where the started server writes its log")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="a further flag for the started server"
    )
    args = parser.parse_args(argv)
    if not (args.requests >= 1 and args.concurrency >= 1 and 1 <= args.max_tokens[0] <= args.max_tokens[1]):
        parser.error("--requests, --concurrency and --max-tokens must be positive (MIN <= MAX)")
    server = None
    if args.url is None:
        log_path = args.server_log or Path(tempfile.mkdtemp(prefix="fornax-soak-")) / "server.log"
        # An open server (no keys), whose /admin/state needs none.
        env = {k: v for k, v in os.environ.items() if k not in ("FORNAX_API_KEY", "FORNAX_ADMIN_KEY")}
        server = FornaxProcess(
            "soak server", ["serve", args.model, *MAKE_RUN_FLAGS, *args.server_arg], log_path, env
        )
        print(f"soak: starting fornax {' '.join(server.args)} (log: {log_path})", flush=True)
        try:
            server.wait_ready(timeout_s=600.0)
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            print(f"soak: {exc}", file=sys.stderr)
            return 2
    url = args.url or server.url
    pid = args.pid or (server.proc.pid if server else None)
    try:
        report = run_soak(
            url,
            args.requests,
            args.concurrency,
            disconnect_fraction=args.disconnect_fraction,
            malformed_fraction=args.malformed_fraction,
            max_tokens=tuple(args.max_tokens),
            pid=pid,
            api_key=args.api_key,
            admin_key=args.admin_key,
            model=args.model,
            timeout_s=args.timeout,
            seed=args.seed,
            rss_window=args.rss_window,
            progress_every=args.progress_every,
            warm_kv=not args.no_kv_warmup,
        )
    finally:
        exit_code = server.stop(timeout_s=90.0) if server else None
    report.server_exit_code = exit_code
    print(report.summary(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
