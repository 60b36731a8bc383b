"""/v1/embeddings, /v1/rerank and /v1/score on a real server serving a chat model and the real
embedding model side by side, through the official `openai` client where it has a call: shapes,
base64, batching, ordering by similarity, and bad input answered with a clear 4xx."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
CHAT, EMBED = "smollm2-135m-instruct", "all-minilm-l6-v2"
TEXTS = [
    "The capital of France is Paris.",
    "Bananas are yellow.",
    "def add(a, b): return a + b",
    "北京是中国的首都。",
    "Paris is the capital city of France.",
]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(["--model", CHAT, "--model", EMBED, "--no-access-log"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


def test_embeddings_shape_usage_batching_and_base64(server, client) -> None:
    r = client.embeddings.create(model=EMBED, input=TEXTS)
    assert r.object == "list" and r.model == EMBED and [d.index for d in r.data] == list(range(len(TEXTS)))
    vectors = [d.embedding for d in r.data]
    assert all(len(v) == 384 and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)
    counts = [
        httpx.post(server.url + "/tokenize", json={"model": EMBED, "prompt": t}).json()["count"]
        for t in TEXTS
    ]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    # Alone or in a batch: the same vector (bf16 here: to rounding).
    for text, batched in zip(TEXTS, vectors, strict=True):
        alone = client.embeddings.create(model=EMBED, input=text).data[0].embedding
        assert _cos(alone, batched) > 0.9999
    raw = httpx.post(
        server.url + "/v1/embeddings", json={"model": EMBED, "input": TEXTS[:2], "encoding_format": "base64"}
    ).json()
    decoded = [list(struct.unpack(f"<{384}f", base64.b64decode(d["embedding"]))) for d in raw["data"]]
    assert all(abs(x - y) < 1e-6 for a, b in zip(decoded, vectors[:2], strict=True) for x, y in zip(a, b))
    ids = client.embeddings.create(model=EMBED, input=[[101, 7592, 102]]).data[0].embedding
    assert len(ids) == 384
    assert _cos(vectors[0], vectors[4]) > _cos(vectors[0], vectors[1])  # meaning, not noise


def test_rerank_and_score_order_by_the_embeddings_cosine(server, client) -> None:
    vectors = [d.embedding for d in client.embeddings.create(model=EMBED, input=TEXTS).data]
    query, docs = TEXTS[0], TEXTS[1:]
    r = httpx.post(
        server.url + "/v1/rerank", json={"model": EMBED, "query": query, "documents": docs, "top_n": 3}
    ).json()
    expected = sorted(range(len(docs)), key=lambda i: -_cos(vectors[0], vectors[i + 1]))[:3]
    assert [x["index"] for x in r["results"]] == expected and r["results"][0]["document"]["text"] == TEXTS[4]
    assert all(
        abs(x["relevance_score"] - _cos(vectors[0], vectors[x["index"] + 1])) < 1e-3 for x in r["results"]
    )
    s = httpx.post(server.url + "/v1/score", json={"model": EMBED, "text_1": query, "text_2": docs}).json()
    assert [round(d["score"], 3) for d in s["data"]] == [round(_cos(vectors[0], v), 3) for v in vectors[1:]]
    pairs = httpx.post(
        server.url + "/v1/score", json={"model": EMBED, "text_1": TEXTS[:2], "text_2": TEXTS[3:]}
    )
    assert len(pairs.json()["data"]) == 2


def test_models_say_what_they_serve_and_chat_to_an_embedder_is_a_400(client) -> None:
    cards = {m.id: m.model_extra["endpoints"] for m in client.models.list().data}
    assert cards[EMBED] == ["embeddings", "rerank", "score"] and "chat" in cards[CHAT]
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=EMBED, prompt="Hi", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input": ""}, "empty string"),
        ({"input": []}, "must not be empty"),
        ({"input": ["x"] * 10_000}, "at most"),
        ({"input": [[10**9]]}, "out of range"),
        ({"input": "word " * 2000}, "context"),
        ({"input": "x", "dimensions": 10}, "dimensions"),
        ({"input": [-997, -7820124], "dimensions": -1014}, "dimensions"),  # found by the campaign: was a 500
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_clear_400(server, body, match) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"model": EMBED, **body}, timeout=60)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


def test_truncation_only_when_asked(server) -> None:
    long = "word " * 2000
    r = httpx.post(
        server.url + "/v1/embeddings", json={"model": EMBED, "input": long, "truncate_prompt_tokens": 64}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
