"""The streaming client against a real (fake) HTTP server: counts, timing, failures."""

from __future__ import annotations

import asyncio
import statistics

import numpy as np
import pytest

from fornax.bench import client as bc
from fornax.bench.report import summarize
from fornax.bench.workloads import BenchRequest, arrival_offsets, random_workload


def _run(
    url: str,
    reqs: list[BenchRequest],
    endpoint: str = "chat",
    offsets: np.ndarray | None = None,
    max_concurrency: int | None = None,
    timeout_s: float | None = 10.0,
):
    target = bc.Target(url, "fake-model", endpoint)
    offs = np.zeros(len(reqs)) if offsets is None else offsets
    return asyncio.run(bc.run_load(target, reqs, offs, max_concurrency, timeout_s))


def test_counts_and_timing_match_the_injected_delays(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.08, itl_s=0.03)
    reqs = random_workload(6, input_len=20, output_len=6, seed=0)
    results, duration = _run(fake_server.url, reqs)
    s = summarize(results, duration)
    assert (s.completed, s.failed) == (6, 0)
    assert all(r.output_tokens == 6 and r.usage_reported and r.num_chunks == 6 for r in results)
    assert all(r.prompt_tokens == 7 for r in results)  # the fake's usage, not the estimate
    assert s.total_output_tokens == 36
    # Delays are lower bounds; the upper bounds leave room for a busy shared machine.
    assert all(0.075 <= r.ttft_s <= 0.5 for r in results)  # the role-only first chunk does not count
    assert all(len(r.itl_s) == 5 for r in results)
    itl = statistics.median(g for r in results for g in r.itl_s)
    assert 0.025 <= itl <= 0.15
    assert 0.025 <= s.tpot_ms.median / 1000 <= 0.15
    assert all(r.e2el_s >= r.ttft_s + 5 * 0.028 for r in results)
    assert duration >= 0.08 + 5 * 0.03


def test_request_body_is_openai_shaped(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.0)
    _run(fake_server.url, [BenchRequest("hello there", 2, 3, ignore_eos=True)])
    body = fake_server.state.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_tokens"] == 3 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 3


def test_completions_endpoint_and_usage_over_chunks(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.005, tokens_per_chunk=3)
    req = BenchRequest("a b c", 3, 9, ignore_eos=False)
    results, _ = _run(fake_server.url, [req], endpoint="completions")
    (r,) = results
    assert r.success and r.num_chunks == 3 and r.output_tokens == 9  # usage wins over chunk count
    body = fake_server.state.bodies[0]
    assert body["prompt"] == "a b c" and "ignore_eos" not in body


def test_without_usage_output_tokens_fall_back_to_chunks(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.0, tokens_per_chunk=2, send_usage=False)
    results, _ = _run(fake_server.url, [BenchRequest("x", 1, 8, ignore_eos=True)])
    assert results[0].success and not results[0].usage_reported and results[0].output_tokens == 4


def test_http_errors_are_counted_with_their_message(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.0, fail_every=3)
    results, duration = _run(fake_server.url, random_workload(9, 5, 2, seed=0), max_concurrency=2)
    s = summarize(results, duration)
    assert (s.completed, s.failed) == (6, 3)
    errors = [r.error for r in results if not r.success]
    assert errors == ["HTTP 500: injected failure"] * 3


def test_connection_errors_and_timeouts_fail_without_raising(fake_server, closed_port_url) -> None:
    results, _ = _run(closed_port_url, random_workload(3, 5, 2, seed=0))
    assert not any(r.success for r in results)
    assert all(r.error and "Connect" in r.error for r in results)
    fake_server.state.reset(ttft_s=1.0, itl_s=0.0)
    results, duration = _run(fake_server.url, random_workload(2, 5, 2, seed=0), timeout_s=0.2)
    assert all(not r.success and r.error.startswith("timeout") for r in results)
    assert duration < 0.9


def test_max_concurrency_caps_requests_in_flight(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.03, itl_s=0.01)
    results, _ = _run(fake_server.url, random_workload(8, 5, 3, seed=0), max_concurrency=2)
    assert all(r.success for r in results)
    assert fake_server.state.max_in_flight == 2


def test_requests_are_sent_on_the_arrival_schedule(fake_server) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.0)
    offsets = arrival_offsets(6, request_rate=20.0, seed=5)
    results, duration = _run(fake_server.url, random_workload(6, 5, 2, seed=0), offsets=offsets)
    starts = np.array([r.start_s for r in results])
    assert np.all(starts >= offsets - 1e-3) and np.all(starts <= offsets + 0.1)
    assert duration >= offsets[-1]


def test_helpers_model_and_tokenize(fake_server) -> None:
    assert asyncio.run(bc.fetch_first_model(fake_server.url, None)) == "fake-model"
    assert asyncio.run(bc.tokens_per_word(fake_server.url, "m", None, "a b c d")) is None  # no /tokenize
    fake_server.state.reset(tokenize_ratio=1.5)
    assert asyncio.run(bc.tokens_per_word(fake_server.url, "m", None, "a b c d")) == pytest.approx(1.5)


@pytest.mark.parametrize(
    "url,root",
    [
        ("http://h:1", "http://h:1"),
        ("http://h:1/v1/", "http://h:1"),
        ("https://x.y/api/v1", "https://x.y/api"),
    ],
)
def test_normalize_base_url(url: str, root: str) -> None:
    assert bc.normalize_base_url(url) == root


def test_normalize_base_url_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="base-url"):
        bc.normalize_base_url("localhost:8000")
