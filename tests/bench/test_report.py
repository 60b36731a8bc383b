"""Summary numbers and goodput from hand-made results: no server."""

from __future__ import annotations

import math

import pytest

from fornax.bench.client import RequestResult
from fornax.bench.report import format_sweep_table, format_table, meets_slos, parse_goodput, summarize


def _ok(i: int, ttft: float, e2e: float, out: int, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(
        index=i,
        success=True,
        prompt_tokens=10,
        output_tokens=out,
        usage_reported=True,
        ttft_s=ttft,
        e2el_s=e2e,
        itl_s=itl or [],
        num_chunks=out,
    )


def test_tpot_definition() -> None:
    r = _ok(0, ttft=0.1, e2e=1.0, out=10)
    assert r.tpot_s == pytest.approx(0.1)
    assert _ok(1, 0.1, 0.1, out=1).tpot_s is None


def test_summary_numbers() -> None:
    results = [
        _ok(0, 0.1, 0.5, 5, [0.1] * 4),
        _ok(1, 0.3, 1.1, 5, [0.2] * 4),
        RequestResult(index=2, success=False, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.total_output_tokens == 10 and s.total_prompt_tokens == 20
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(5.0)
    assert s.total_token_throughput == pytest.approx(15.0)
    assert s.ttft_ms.mean == pytest.approx(200.0) and s.ttft_ms.median == pytest.approx(200.0)
    assert s.tpot_ms.mean == pytest.approx(150.0)
    assert s.itl_ms.count == 8 and s.itl_ms.mean == pytest.approx(150.0)
    assert s.e2el_ms.p99 == pytest.approx(1094.0)
    assert s.goodput is None
    assert "Failed requests" in format_table(s) and "TTFT" in format_table(s)
    assert "concurrency" in format_sweep_table([(4, s)])


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = _ok(0, ttft=0.05, e2e=0.5, out=10)  # tpot 50 ms
    slow_first = _ok(1, ttft=0.5, e2e=0.9, out=10)  # tpot ~44 ms
    slow_decode = _ok(2, ttft=0.05, e2e=2.0, out=10)  # tpot ~217 ms
    one_token = _ok(3, ttft=0.05, e2e=0.05, out=1)
    failed = RequestResult(index=4, success=False, error="x")
    slos = parse_goodput(["ttft:100", "tpot:60"])
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, one_token, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    s = summarize([fast, slow_first, slow_decode, one_token, failed], duration_s=4.0, slos_ms=slos)
    assert s.good_requests == 2 and s.goodput == pytest.approx(0.5)
    assert "Goodput" in format_table(s)
    assert summarize([fast], 1.0, parse_goodput(["e2el:400"])).good_requests == 0


@pytest.mark.parametrize("bad", ["ttft", "foo:10", "ttft:abc", "tpot:-1", "e2el:0"])
def test_parse_goodput_rejects_bad_specs(bad: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_empty_run_has_nan_stats_but_formats() -> None:
    s = summarize([RequestResult(index=0, success=False, error="x")], 1.0)
    assert s.completed == 0 and math.isnan(s.ttft_ms.mean)
    assert s.to_dict()["ttft_ms"]["mean"] is None
    assert "-" in format_table(s)
