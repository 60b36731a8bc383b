"""Several models behind one server (server/model_set.py): routing by the `model` field, each
model's own metrics, lazy loading with least-recently-used unloading, and the engines
sharing one engine thread without OpenMP oversubscription."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from fornax import LLM, SamplingParams
from fornax.config import ConfigError
from fornax.server_args import served_names
from tests.model.tiny_models import build_tiny_model
from tests.server.test_engine_thread import voluntary_switches

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
PROMPTS = {SMOL: "The capital of France is", GEMMA: "什么是 LLM 推理？"}


def _series(metrics: str, name: str, model: str) -> float:
    """The sum of a metric's samples for one model, over its other labels (0 when absent)."""
    lines = [ln for ln in metrics.splitlines() if ln.startswith(name + "{") and f'model_name="{model}"' in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_two_models_answer_alternately_with_their_own_outputs(make_server, gemma3_gguf):
    # OpenMP's default waiting (test_engine_thread.py says why the barriers are counted)
    server = make_server(
        ["--model", SMOL, "--model", GEMMA, "--max-model-len", "2048", "--no-access-log"],
        env={"OMP_WAIT_POLICY": None},
    )
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [SMOL, GEMMA] and all(m["max_model_len"] == 2048 for m in models)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got: dict[str, list[str]] = {SMOL: [], GEMMA: []}
    for _ in range(2):
        for model in (SMOL, GEMMA, SMOL, GEMMA):
            r = client.completions.create(model=model, prompt=PROMPTS[model], max_tokens=16, temperature=0.0)
            assert r.model == model
            got[model].append(r.choices[0].text)
    # each model's own greedy answer, as the offline engine gives it alone (one request per step)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for model in (SMOL, GEMMA):
        ref = (
            LLM(model, max_model_len=2048, progress=False)
            .generate([PROMPTS[model]], params)[0]
            .outputs[0]
            .text
        )
        assert got[model] == [ref] * 4, model
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for model in (SMOL, GEMMA):
        assert _series(metrics, "fornax:request_success_total", model) == 4  # finished by length
        assert _series(metrics, "fornax:model_loaded", model) == 1
    assert metrics.count("# TYPE fornax:request_success_total counter") == 1  # one family, both models
    # both engines on the one engine thread: decode steps do not sleep at OpenMP barriers
    # (a second thread with its own OpenMP team would make them; tests/server/test_engine_thread.py)
    body = {
        "model": GEMMA,
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    before = voluntary_switches(server.proc.pid)
    httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    assert (voluntary_switches(server.proc.pid) - before) / 48 < 25
    bad = httpx.post(server.url + "/v1/completions", json={**body, "model": "nope"}, timeout=10)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", out)
    return out


def test_lazy_loading_keeps_at_most_k_and_unloads_the_least_recently_used(make_server, tiny_dir):
    server = make_server(
        [
            "--model",
            SMOL,
            "--model",
            str(tiny_dir),
            "--served-model-name",
            "smol",
            "--served-model-name",
            "tiny",
            "--max-loaded-models",
            "1",
            "--no-access-log",
        ]
    )
    state = server.state()
    assert [m["loaded"] for m in state["models"]] == [False, False]  # nothing until asked for

    def ask(model: str, max_tokens: int = 4) -> httpx.Response:
        body = {"model": model, "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0.0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

    first = ask("smol").json()["choices"][0]["text"]
    for model in ("tiny", "smol", "tiny"):
        assert ask(model).status_code == 200
        assert [m["loaded"] for m in server.state()["models"]] == [model == "smol", model == "tiny"]
    assert ask("smol").json()["choices"][0]["text"] == first  # reloaded, same answer
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert _series(metrics, "fornax:model_loads_total", "smol") == 3
    assert _series(metrics, "fornax:model_unloads_total", "smol") == 2
    assert _series(metrics, "fornax:model_loads_total", "tiny") == 2
    assert _series(metrics, "fornax:model_load_seconds_count", "tiny") == 2

    # a busy model is not unloaded: while a long request runs on smol, tiny cannot load
    long_done = threading.Event()
    results: dict[str, int] = {}

    def long_request() -> None:
        results["long"] = ask("smol", max_tokens=400).status_code
        long_done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 20
    while server.state()["models"][0].get("engine_streams", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    busy = ask("tiny")
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "models_busy"
    assert busy.headers["retry-after"] == "1"
    worker.join(timeout=120)
    assert results["long"] == 200
    # two requests for an unloaded model share one load
    statuses: list[int] = []
    pair = [threading.Thread(target=lambda: statuses.append(ask("tiny").status_code)) for _ in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=120)
    assert statuses == [200, 200]
    assert (
        _series(httpx.get(server.url + "/metrics", timeout=10).text, "fornax:model_loads_total", "tiny") == 3
    )


def test_served_names_one_per_model():
    assert served_names(["a", "b"], None) == [("a",), ("b",)]
    assert served_names(["a"], ["x", "y"]) == [("x", "y")]  # one model: aliases
    assert served_names(["a", "b"], ["x", "y"]) == [("x",), ("y",)]
    with pytest.raises(ConfigError, match="one per model"):
        served_names(["a", "b"], ["x"])
    with pytest.raises(ConfigError, match="differ"):
        served_names(["a", "b"], ["x", "x"])
