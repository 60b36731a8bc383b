"""`fornax serve --speculative-config`: the flag works, responses carry acceptance figures in
the `fornax` timings extension, /metrics counts drafts, and bad configs fail with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.server.test_metrics import parse, value
from tests.support import ROOT

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PROMPT = "one two three four five six seven eight. one two three four five six seven eight. one two three"


def test_serve_with_ngram_speculation_reports_acceptance(make_server):
    server = make_server(["--speculative-config", json.dumps(SPEC), "--public-metrics"])
    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    timings = r.json()["fornax"]
    assert 0.0 <= timings["spec_acceptance_rate"] <= 1.0
    assert timings["spec_mean_accepted_len"] >= 1.0
    # Per request, speculation can be turned off: no figures then.
    r = httpx.post(server.url + "/v1/completions", json=body | {"num_speculative_tokens": 0}, timeout=120)
    assert "spec_acceptance_rate" not in r.json()["fornax"]
    samples = parse(httpx.get(server.url + "/metrics", timeout=10).text)
    drafts = value(samples, "fornax:spec_decode_num_draft_tokens_total")
    assert drafts > 0 and 0 < value(samples, "fornax:spec_decode_num_accepted_tokens_total") <= drafts
    assert value(samples, "fornax:spec_decode_acceptance_rate_count") == 1
    server.assert_idle()


def test_bad_speculative_config_is_one_clear_line():
    cmd = [sys.executable, "-m", "fornax.cli", "serve", "--speculative-config", '{"method": "ngram", "k": 3}']
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "unknown speculative config key(s) ['k']" in done.stderr and "Traceback" not in done.stderr
