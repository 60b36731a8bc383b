"""/v1/rerank and /v1/score on a real server serving a tiny random cross-encoder
(BertForSequenceClassification, built by transformers in the test): scores against
transformers' own, the /v1/models card, /v1/embeddings refused with a 400, and the embedding
metrics counting these requests."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch

from tests.model.tiny_models import TRAIN_TEXT, build_tiny_cross_encoder

QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "def add(a, b): return a + b", TRAIN_TEXT[2], "batching", TRAIN_TEXT[3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    out = tmp_path_factory.mktemp("ce")
    return build_tiny_cross_encoder(out), out


@pytest.fixture(scope="module")
def server(make_server, model):
    _, out = model
    return make_server(
        ["--model", str(out), "--served-model-name", "ce", "--dtype", "float32", "--no-access-log"]
    )


def _reference(model: tuple[torch.nn.Module, Path], pairs: list[tuple[str, str]]) -> list[float]:
    from transformers import AutoTokenizer

    hf, out = model
    enc = AutoTokenizer.from_pretrained(str(out))(
        [a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt"
    )
    with torch.inference_mode():
        return torch.sigmoid(hf(**enc).logits[:, 0]).tolist()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf'^{re.escape(name)}\{{model_name="ce"\}} (\S+)$', text, re.M)
    assert match, name
    return float(match.group(1))


def test_rerank_and_score_are_the_heads_scores(server, model) -> None:
    before = {
        n: _metric(server, f"fornax:{n}")
        for n in (
            "embedding_requests_total",
            "embedding_prompt_tokens_total",
            "embedding_request_latency_seconds_count",
        )
    }
    ref = _reference(model, [(QUERY, d) for d in DOCS])
    r = httpx.post(
        server.url + "/v1/rerank",
        json={"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 4},
        timeout=60,
    ).json()
    expected = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:4]
    assert [x["index"] for x in r["results"]] == expected, r
    assert all(abs(x["relevance_score"] - ref[x["index"]]) < 1e-4 for x in r["results"])
    assert r["results"][0]["document"]["text"] == DOCS[expected[0]]
    s = httpx.post(
        server.url + "/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS}, timeout=60
    )
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(ref, abs=1e-4)
    firsts = [DOCS[-1], QUERY, "hardware", TRAIN_TEXT[1], "fox"]
    pairwise = httpx.post(
        server.url + "/v1/score", json={"model": "ce", "text_1": firsts, "text_2": DOCS}, timeout=60
    ).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        _reference(model, list(zip(firsts, DOCS))), abs=1e-4
    )
    tokens = (
        r["usage"]["total_tokens"] + s.json()["usage"]["prompt_tokens"] + pairwise["usage"]["prompt_tokens"]
    )
    assert _metric(server, "fornax:embedding_requests_total") == before["embedding_requests_total"] + 3
    assert (
        _metric(server, "fornax:embedding_prompt_tokens_total")
        == before["embedding_prompt_tokens_total"] + tokens
    )
    count = _metric(server, "fornax:embedding_request_latency_seconds_count")
    assert count == before["embedding_request_latency_seconds_count"] + 3


def test_models_card_and_refusals(server) -> None:
    cards = {m["id"]: m["endpoints"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["ce"] == ["rerank", "score"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "ce", "input": "hello"}, timeout=10)
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"], r.text
    chat = {"model": "ce", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"], r.text
    bad = [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "as many as text_2"),
        ("/v1/score", {"text_1": [], "text_2": ["c"]}, "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": ["ok", ""]}, "empty string"),
        ("/v1/rerank", {"query": "q", "documents": ["word " * 400]}, "context"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 10_000}, "at most"),
    ]
    for path, body, match in bad:
        r = httpx.post(server.url + path, json={"model": "ce", **body}, timeout=10)
        assert r.status_code == 400 and match in r.json()["error"]["message"], (path, body, r.text)
    cut = httpx.post(
        server.url + "/v1/rerank",
        json={"model": "ce", "query": QUERY, "documents": ["word " * 400], "truncate_prompt_tokens": 32},
        timeout=10,
    )
    assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 32, cut.text
