"""HTTP side of the benchmark: stream one request and time its chunks, and drive a whole run.

Timing model (all times from `time.perf_counter()`):
  - a request's clock starts when it is sent (after any concurrency slot is acquired);
  - TTFT is the arrival of the first chunk that carries generated text;
  - ITL is every gap between consecutive text-carrying chunks;
  - E2E is the arrival of the last byte of the stream.
A failure of any kind (HTTP status, connection, timeout, malformed stream) becomes a failed
RequestResult with its message; nothing here raises for a single request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from fornax.bench import BenchUsageError
from fornax.bench.workloads import BenchRequest


@dataclass
class RequestResult:
    index: int
    success: bool
    error: str | None = None
    start_s: float = 0.0  # send time, seconds after the run's start
    prompt_tokens: int = 0  # from usage when the server sent it, else the workload's estimate
    output_tokens: int = 0  # from usage when the server sent it, else the number of text chunks
    usage_reported: bool = False
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    output_chars: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.success or self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


@dataclass(frozen=True)
class Target:
    """Where and how to send: the server root, the endpoint kind and the fixed request fields."""

    base_url: str  # server root, without /v1
    model: str
    endpoint: str = "chat"  # "chat" or "completions"
    api_key: str | None = None
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.ignore_eos:
            # Not OpenAI fields: vLLM-style servers honour them, OpenAI itself ignores them.
            body["ignore_eos"] = True
            body["min_tokens"] = req.output_len
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        body.update(self.extra_body)
        return body


def normalize_base_url(url: str) -> str:
    """Accept `http://h:p`, `http://h:p/` or `http://h:p/v1`; return the root without a slash."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchUsageError(f"--base-url must start with http:// or https://, got {url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _chunk_text(event: dict[str, Any], endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _StreamError(Exception):
    pass


async def _read_stream(resp: httpx.Response, target: Target, t0: float, result: RequestResult) -> None:
    """Consume the SSE body, filling timing and token fields of `result`."""
    last: float | None = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError:
            raise _StreamError(f"malformed SSE data: {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise _StreamError(f"unexpected SSE data: {data[:200]!r}")
        if event.get("error"):
            err = event["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise _StreamError(f"error in stream: {message}")
        now = time.perf_counter()
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
            result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
            result.usage_reported = True
        text = _chunk_text(event, target.endpoint)
        if not text:
            continue
        if last is None:
            result.ttft_s = now - t0
        else:
            result.itl_s.append(now - last)
        last = now
        result.num_chunks += 1
        result.output_chars += len(text)


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    req: BenchRequest,
    index: int,
    run_start: float,
    timeout_s: float | None = None,
) -> RequestResult:
    """Stream one request and time it; every failure is returned, never raised."""
    t0 = time.perf_counter()
    result = RequestResult(index=index, success=False, start_s=t0 - run_start, prompt_tokens=req.prompt_len)
    try:
        async with asyncio.timeout(timeout_s):
            body, headers = target.payload(req), target.headers
            async with client.stream("POST", target.url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                    return result
                await _read_stream(resp, target, t0, result)
        result.e2el_s = time.perf_counter() - t0
        if result.ttft_s is None:
            result.error = "stream ended without any generated text"
            return result
        if not result.usage_reported:
            result.output_tokens = result.num_chunks  # one chunk per token is the common case
        result.success = True
    except TimeoutError:
        result.error = f"timeout: no complete response within {timeout_s} s"
    except _StreamError as exc:
        result.error = str(exc)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _error_message(body: str) -> str:
    """The message of an OpenAI error envelope, else the (truncated) body."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
    except (ValueError, AttributeError):
        pass
    return body.strip()[:500] or "(empty body)"


def make_client(max_concurrency: int | None, timeout_s: float | None) -> httpx.AsyncClient:
    # httpx caps a pool at 100 connections by default; a larger burst would queue inside the
    # client and show up as server TTFT. Leave the pool unbounded and let the semaphore limit.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency or 1024)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=timeout_s))


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    offsets: np.ndarray,
    max_concurrency: int | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `requests[i]` at `offsets[i]` seconds after the start (and when a slot is free).

    Returns the results in request order and the run's duration: from the first send to the
    last response.
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, client: httpx.AsyncClient, run_start: float) -> RequestResult:
        if sem is None:
            res = await send_request(client, target, requests[i], i, run_start, timeout_s)
        else:
            async with sem:
                res = await send_request(client, target, requests[i], i, run_start, timeout_s)
        if on_done is not None:
            on_done(res)
        return res

    async with make_client(max_concurrency, timeout_s) as client:
        run_start = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        for i, offset in enumerate(offsets):
            delay = run_start + float(offset) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, client, run_start)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_start
    return results, duration


async def fetch_first_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str | None:
    """The first model id from GET /v1/models, or None when the server does not say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(base_url + "/v1/models", headers=headers)
            data = resp.json().get("data") if resp.status_code == 200 else None
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


async def tokens_per_word(
    base_url: str, model: str, api_key: str | None, sample: str, timeout_s: float = 10.0
) -> float | None:
    """Tokens per word of `sample` by the server's POST /tokenize, or None if it has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": sample, "add_special_tokens": False}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.post(base_url + "/tokenize", json=body, headers=headers)
            if resp.status_code != 200:
                return None
            data = resp.json()
            count = data.get("count", len(data.get("tokens") or []))
    except (httpx.HTTPError, ValueError, AttributeError, TypeError):
        return None
    words = len(sample.split())
    return count / words if count and words else None
