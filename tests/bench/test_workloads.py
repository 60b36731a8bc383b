"""Workloads and arrival times: pure, seeded, no server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fornax.bench import workloads as w


def test_random_workload_is_seeded_and_in_range() -> None:
    a = w.random_workload(50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    b = w.random_workload(50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    c = w.random_workload(50, input_len=100, output_len=20, range_ratio=0.5, seed=4)
    assert a == b and a != c
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 and r.ignore_eos for r in a)
    assert len({r.prompt.split()[0:5].__str__() for r in a}) > 40  # prompts do not share a prefix
    # With 1 token per word, the word count is the target length.
    assert all(len(r.prompt.split()) == r.prompt_len for r in a)


def test_random_text_uses_tokens_per_word() -> None:
    text = w.random_text(np.random.default_rng(0), 300, tokens_per_word=1.5)
    assert len(text.split()) == 200


def test_random_workload_rejects_bad_ratio() -> None:
    with pytest.raises(ValueError, match="range-ratio"):
        w.random_workload(2, 10, 10, range_ratio=1.5)


def test_prefix_repetition_shares_prefixes() -> None:
    reqs = w.prefix_repetition_workload(24, prefix_len=40, num_prefixes=3, suffix_len=8, output_len=5, seed=1)
    assert len(reqs) == 24
    prefixes = {" ".join(r.prompt.split()[:40]) for r in reqs}
    assert len(prefixes) == 3
    suffixes = {" ".join(r.prompt.split()[40:]) for r in reqs}
    assert len(suffixes) == 24
    assert all(r.prompt_len == 48 and r.output_len == 5 for r in reqs)


def test_sharegpt_first_exchange(tmp_path) -> None:
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Tell me about the history of tea in China"},
                {"from": "gpt", "value": " ".join(["word"] * 40)},
                {"from": "human", "value": "and Japan?"},
            ],
        },
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},  # no human turn: skipped
        # Too short on both sides: skipped.
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {
            "id": "d",
            "conversations": [
                {"from": "human", "value": "Explain recursion with an example please"},
                {"from": "gpt", "value": "Recursion is when a function calls itself again"},
            ],
        },
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = w.sharegpt_workload(path, num_prompts=5, seed=0)
    assert len(reqs) == 5
    firsts = {data[0]["conversations"][0]["value"], data[3]["conversations"][0]["value"]}
    assert {r.prompt for r in reqs} == firsts
    tea = next(r for r in reqs if "tea" in r.prompt)
    assert 40 <= tea.output_len <= 60 and not tea.ignore_eos
    assert all(r.output_len == 9 for r in w.sharegpt_workload(path, 3, output_len=9))


def test_sharegpt_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        w.sharegpt_workload(tmp_path / "missing.json", 1)
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(ValueError, match="no usable"):
        w.sharegpt_workload(tmp_path / "x.json", 1)


def test_builtin_prompts_are_varied() -> None:
    prompts = w.builtin_prompts()
    assert 25 <= len(prompts) <= 40
    kinds = {p["kind"] for p in prompts}
    assert {"question", "coding", "summarize", "cjk"} <= kinds
    assert any(any(0x4E00 <= ord(ch) <= 0x9FFF for ch in p["prompt"]) for p in prompts)
    reqs = w.builtin_workload(70, seed=2)
    assert len(reqs) == 70 and len({r.prompt for r in reqs}) == len(prompts)


def test_approx_token_count_handles_cjk() -> None:
    assert w.approx_token_count("你好世界") == 4
    assert 8 <= w.approx_token_count("the quick brown fox jumps over the lazy dog") <= 13


def test_arrivals_are_reproducible_and_have_the_right_rate() -> None:
    a = w.arrival_offsets(2000, request_rate=50.0, burstiness=1.0, seed=7)
    assert np.array_equal(a, w.arrival_offsets(2000, 50.0, 1.0, seed=7))
    assert not np.array_equal(a, w.arrival_offsets(2000, 50.0, 1.0, seed=8))
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.15)  # exponential: CV 1


def test_burstiness_changes_spread_not_rate() -> None:
    bursty = np.diff(w.arrival_offsets(4000, 10.0, burstiness=0.25, seed=1))
    smooth = np.diff(w.arrival_offsets(4000, 10.0, burstiness=4.0, seed=1))
    for gaps in (bursty, smooth):
        assert gaps.mean() == pytest.approx(0.1, rel=0.15)
    # Gamma with shape k has coefficient of variation 1/sqrt(k).
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.2)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.2)


def test_infinite_rate_sends_all_at_once_and_bad_values_fail() -> None:
    assert np.array_equal(w.arrival_offsets(5, float("inf")), np.zeros(5))
    with pytest.raises(ValueError):
        w.arrival_offsets(5, 0.0)
    with pytest.raises(ValueError):
        w.arrival_offsets(5, 1.0, burstiness=0.0)
