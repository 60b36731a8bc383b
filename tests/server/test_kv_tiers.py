"""KV tiers behind the HTTP server: a SIGTERM drain puts what finished requests left on disk, the
next server on the same directory serves it (cached_tokens counts it), and /metrics says where
tokens came from."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

DOC = "Answer from this text. " + " ".join(
    f"line {i}: the river rose and the farmers moved uphill." for i in range(25)
)


def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def _ask(server, question: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model="m", prompt=DOC + "\nQ: " + question, max_tokens=6, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def test_disk_tier_outlives_the_server(make_server, tmp_path):
    # 40 blocks of 16: one ~350-token request fits with room to spare.
    args = [
        "--served-model-name",
        "m",
        "--num-blocks",
        "40",
        "--kv-offload-memory",
        "32MiB",
        "--kv-offload-dir",
        str(tmp_path / "kv"),
        "--kv-offload-disk",
        "1GiB",
    ]
    # The reference answers from its primary prefix cache: the same attention path (a cached
    # prefix, then the question) as an answer from the disk tier, so the same bits.
    reference = make_server(["--served-model-name", "m", "--num-blocks", "40"])
    _ask(reference, "what rose?")
    want, hit = _ask(reference, "where did the farmers go?")
    assert hit >= 256

    first = make_server(args)
    text, cached = _ask(first, "what rose?")
    assert cached == 0
    assert first.stop() == 0  # the drain flushes the finished request's blocks to disk
    assert list((tmp_path / "kv").rglob("*.kv"))

    second = make_server(args)
    text, cached = _ask(second, "where did the farmers go?")
    assert text == want
    assert cached == hit, f"the document should come back from disk, got {cached} cached tokens"
    assert _metric(second, "fornax:kv_offload_hit_tokens_total", tier="disk") == cached
    assert _metric(second, "fornax:kv_offload_bytes_total", direction="from_disk") > 0
    assert _metric(second, "fornax:kv_offload_usage_perc", tier="disk") > 0
    assert _metric(second, "fornax:kv_offload_transfer_seconds_count", kind="load") >= 1
