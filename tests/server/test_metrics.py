"""/metrics against a real server: counters move by exactly what the responses report.

One server for the module; every test scrapes before and after its own requests and
compares deltas, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from fornax.config import EngineConfig, ServerConfig
from fornax.engine.stats import EngineStats
from fornax.metrics.prometheus import EngineSnapshot, Metrics, token_buckets
from fornax.server.app import create_app

KEY = "sk-test-metrics-0123456789"
MODEL = "smollm2-135m-instruct"


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model_name": MODEL, **labels}.items())), 0.0)


# ---- in-process: no model load -------------------------------------------------------------------


def test_token_buckets_end_at_max_context():
    assert token_buckets(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 8192)
    assert token_buckets(10) == (1, 2, 5, 10)


def engine_stats(
    running: int,
    waiting: int,
    free_blocks: int,
    preemptions: int,
    queries: int,
    hits: int,
    drafts: int = 0,
    accepted: int = 0,
) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=waiting,
        num_preemptions_total=preemptions,
        block_size=16,
        num_kv_blocks=64,
        num_free_kv_blocks=free_blocks,
        kv_cache_usage=1.0 - free_blocks / 64,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        spec_num_draft_tokens_total=drafts,
        spec_num_accepted_tokens_total=accepted,
        last_step_num_batched_tokens=0,
        last_step_num_seqs=0,
    )


def test_engine_totals_are_mirrored_by_delta():
    m = Metrics(MODEL)
    m.refresh(EngineSnapshot(engine_stats(2, 1, 32, 3, 100, 40, drafts=10, accepted=6)))
    s = parse(m.render().decode())
    assert value(s, "fornax:num_requests_running") == 2 and value(s, "fornax:num_requests_waiting") == 1
    assert value(s, "fornax:kv_cache_usage_perc") == 0.5
    m.refresh(EngineSnapshot(engine_stats(0, 0, 64, 4, 150, 72, drafts=25, accepted=9)))
    s = parse(m.render().decode())
    assert value(s, "fornax:prefix_cache_queries_total") == 150
    assert value(s, "fornax:prefix_cache_hits_total") == 72
    assert value(s, "fornax:num_preemptions_total") == 4
    assert value(s, "fornax:spec_decode_num_draft_tokens_total") == 25
    assert value(s, "fornax:spec_decode_num_accepted_tokens_total") == 9
    assert value(s, "fornax:num_requests_running") == 0 and value(s, "fornax:kv_cache_usage_perc") == 0


def test_public_metrics_needs_no_key_in_process():
    keys = (("alice", KEY),)
    public = TestClient(create_app(ServerConfig(api_keys=keys, public_metrics=True), EngineConfig()))
    r = public.get("/metrics")  # no lifespan: the model is never loaded
    assert r.status_code == 200 and "fornax:prompt_tokens_total" in r.text
    closed = TestClient(create_app(ServerConfig(api_keys=keys), EngineConfig()))
    assert closed.get("/metrics").status_code == 401


# ---- the real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(["--api-key", KEY, "--no-access-log"], api_key=KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def scrape(server) -> dict:
    r = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.mark.slow
def test_metrics_needs_a_key_and_counts_the_401(server):
    before = scrape(server)
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    after = scrape(server)
    assert delta(before, after, "fornax:request_errors_total", status="401") == 1


@pytest.mark.slow
def test_tokens_success_and_latency_histograms(server, client):
    before = scrape(server)
    n, usages = 3, []
    for i in range(n):
        r = chat(client, f"Count to {i + 3}.", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        usages.append(r.usage)
    after = scrape(server)
    assert delta(before, after, "fornax:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "fornax:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta(before, after, "fornax:request_success_total", finished_reason="length") == n
    assert delta(before, after, "fornax:requests_total", endpoint="chat") == n
    assert delta(before, after, "fornax:requests_total", endpoint="completions") == 0
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_time_per_output_token_seconds",
    ):
        assert delta(before, after, f"fornax:{hist}_count") == n, hist
    num_generated = sum(u.completion_tokens for u in usages)
    assert delta(before, after, "fornax:request_generation_tokens_sum") == num_generated
    # One inter-token gap per token after each sequence's first.
    assert delta(before, after, "fornax:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usages
    )
    assert delta(before, after, "fornax:e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "fornax:engine_step_num_seqs_count") >= 5
    # Every prompt token not served by the prefix cache is computed once, then each output
    # token but the last is fed back once.
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usages]
    assert delta(before, after, "fornax:engine_step_batched_tokens_sum") == sum(
        u.prompt_tokens - c + u.completion_tokens - 1 for u, c in zip(usages, cached)
    )
    # Idle again: the gauges are read at scrape time, so they are not stale.
    server.wait_idle()
    idle = scrape(server)
    assert value(idle, "fornax:num_requests_running") == 0 and value(idle, "fornax:num_requests_waiting") == 0
    assert value(idle, "fornax:kv_cache_usage_perc") == 0
    assert ("fornax:num_preemptions_total", frozenset({("model_name", MODEL)})) in idle


@pytest.mark.slow
def test_prefix_cache_hits_match_cached_tokens(server, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    counts = []
    for _ in range(2):
        before = scrape(server)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        after = scrape(server)
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        assert delta(before, after, "fornax:prefix_cache_hits_total") == cached
        assert delta(before, after, "fornax:prefix_cache_queries_total") == r.usage.prompt_tokens
        counts.append(cached)
    assert counts[1] >= 64 and counts[1] > counts[0]


@pytest.mark.slow
def test_aborted_stream_and_bad_request(server, client):
    before = scrape(server)
    stream = chat(
        client, "Tell a story.", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", temperature=-1)
    server.wait_idle()
    deadline = time.monotonic() + 10
    after = scrape(server)
    while delta(before, after, "fornax:requests_aborted_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        after = scrape(server)
    assert delta(before, after, "fornax:requests_aborted_total") == 1
    assert delta(before, after, "fornax:request_errors_total", status="400") == 1
    # An abort is neither a success nor a latency sample.
    assert delta(before, after, "fornax:e2e_request_latency_seconds_count") == 0
    assert (
        sum(
            delta(before, after, "fornax:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort")
        )
        == 0
    )


def test_bench_serve_token_counts_match_server_metrics(server, tmp_path):
    """`fornax bench serve` against the live server: its JSON agrees with the server's own counters."""
    import json
    import subprocess
    import sys

    server.wait_idle()
    before = scrape(server)
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "fornax.cli",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        KEY,
        "--model",
        MODEL,
        "--dataset",
        "random",
        "--num-prompts",
        "6",
        "--random-input-len",
        "40",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "3",
        "--seed",
        "1",
        "--no-progress",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())["summary"]
    server.wait_idle()
    after = scrape(server)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 8  # ignore_eos + max_tokens honoured
    for bench_key, metric in [
        ("total_output_tokens", "fornax:generation_tokens_total"),
        ("total_prompt_tokens", "fornax:prompt_tokens_total"),
    ]:
        assert value(after, metric) - value(before, metric) == summary[bench_key], metric
