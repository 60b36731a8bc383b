"""`fornax bench serve` end to end against the fake server: tables, JSON, PNG, sweep, errors."""

from __future__ import annotations

import json

from fornax.bench.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(url: str, *extra: str) -> list[str]:
    return [
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        "6",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--no-progress",
        *extra,
    ]


def test_run_writes_table_json_and_png(fake_server, tmp_path, capsys) -> None:
    fake_server.state.reset(ttft_s=0.02, itl_s=0.01, fail_every=4)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        _args(
            fake_server.url,
            "--num-warmups",
            "2",
            "--goodput",
            "ttft:5000",
            "tpot:5000",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        )
    )
    assert rc == 0
    assert len(fake_server.state.bodies) == 8  # 2 warm-ups + 6 measured
    text = capsys.readouterr().out
    assert "Output token throughput" in text and "Goodput" in text and "TPOT" in text
    doc = json.loads(out_json.read_text())
    assert doc["config"]["model"] == "fake-model"  # found through /v1/models
    assert "api_key" not in doc["config"]
    assert len(doc["requests"]) == 6
    s = doc["summary"]
    # The server fails its 4th and 8th requests, both after the two warm-ups.
    assert (s["completed"], s["failed"]) == (4, 2)
    assert s["good_requests"] == s["completed"]
    failed = [r for r in doc["requests"] if not r["success"]]
    assert failed[0]["error"] == "HTTP 500: injected failure"
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_sweep_runs_each_level(fake_server, tmp_path, capsys) -> None:
    fake_server.state.reset(ttft_s=0.01, itl_s=0.005)
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(
        _args(
            fake_server.url,
            "--model",
            "m",
            "--endpoint",
            "completions",
            "--dataset",
            "builtin",
            "--output-len",
            "3",
            "--sweep-concurrency",
            "1,2,4",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        )
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert [lvl["max_concurrency"] for lvl in doc["levels"]] == [1, 2, 4]
    assert all(lvl["summary"]["completed"] == 6 and len(lvl["requests"]) == 6 for lvl in doc["levels"])
    assert all(lvl["summary"]["total_output_tokens"] == 18 for lvl in doc["levels"])
    assert fake_server.state.max_in_flight <= 4
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert "concurrency" in capsys.readouterr().out


def test_calibration_and_prefix_workload(fake_server, capsys) -> None:
    fake_server.state.reset(ttft_s=0.0, itl_s=0.0, tokenize_ratio=2.0)
    rc = main(
        _args(
            fake_server.url,
            "--model",
            "m",
            "--dataset",
            "prefix-repetition",
            "--prefix-len",
            "40",
            "--num-prefixes",
            "2",
            "--suffix-len",
            "10",
            "--request-rate",
            "100",
            "--burstiness",
            "0.5",
        )
    )
    assert rc == 0
    assert "2.000 tokens per word" in capsys.readouterr().err
    prompts = [b["messages"][0]["content"] for b in fake_server.state.bodies]
    assert all(len(p.split()) == 25 for p in prompts)  # (40 + 10) tokens / 2 tokens per word
    assert len({" ".join(p.split()[:20]) for p in prompts}) == 2


def test_user_errors_are_one_line_and_exit_1(fake_server, closed_port_url, capsys) -> None:
    assert main(_args(fake_server.url, "--goodput", "latency:5")) == 1
    assert "--goodput" in capsys.readouterr().err
    assert main(_args(fake_server.url, "--dataset", "sharegpt")) == 1
    assert "--dataset-path" in capsys.readouterr().err
    assert main(_args(fake_server.url, "--sweep-concurrency", "1,x")) == 1
    assert main(_args(closed_port_url)) == 1  # no model to name
    assert "did not name one" in capsys.readouterr().err
    # Every request failing is a finished run with exit code 1, not a crash.
    assert main(_args(closed_port_url, "--model", "m")) == 1
    assert "Failed requests" in capsys.readouterr().out
