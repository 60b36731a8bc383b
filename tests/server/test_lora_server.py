"""LoRA adapters through a real server and the official `openai` client: `--lora` at start,
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time (admin keys only), `model`
picking an adapter, `/v1/models` listing adapters with their base, per-adapter metrics, and
requests running on while adapters come and go, with fewer slots than adapters."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading

import httpx
import openai
import pytest
import torch

from tests.model.test_lora import make_adapter
from tests.model.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow
ADMIN, USER = "sk-lora-admin", "sk-lora-user"
PROMPT = [5, 17, 99, 200, 31, 7, 44, 12]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(make_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    hf = build_tiny_model("qwen2", root / "base")
    adapters = {
        "alpha": (8, 16, ["q_proj", "v_proj", "down_proj"], False),
        "beta": (4, 8, ["o_proj"], False),
        "gamma": (16, 16, ["gate_proj", "up_proj"], True),
    }
    for seed, (name, spec) in enumerate(adapters.items()):
        make_adapter(hf, root / name, *spec, seed=seed)
    server = make_server(
        [
            "--model",
            str(root / "base"),
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--no-access-log",
            "--lora",
            f"alpha={root / 'alpha'}",
            "--lora",
            f"beta={root / 'beta'}",
            "--max-loras",
            "1",
            "--max-lora-rank",
            "16",
            "--admin-key",
            f"ops:{ADMIN}",
            "--api-key",
            f"user:{USER}",
        ],
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=USER, max_retries=0, timeout=60)
    return server, client, hf, root


def _expected(hf, root, name: str | None) -> str:
    """PEFT's greedy continuation for the adapter (the base model's for None), as text."""
    from peft import PeftModel

    from fornax.tokenizer import Tokenizer

    model = hf if name is None else PeftModel.from_pretrained(copy.deepcopy(hf), str(root / name)).eval()
    mask = torch.ones(1, len(PROMPT), dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([PROMPT]), attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return Tokenizer.from_pretrained_dir(root / "base").decode(out[0, len(PROMPT) :].tolist())


def _tokens(client, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text


def _admin(server, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_adapters_answer_as_peft_and_are_listed_with_their_base(setup):
    server, client, hf, root = setup
    assert _tokens(client, "alpha") == _expected(hf, root, "alpha")
    assert _tokens(client, "beta") == _expected(hf, root, "beta")
    assert _tokens(client, "tiny") == _expected(hf, root, None)
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["alpha"]["parent"] == "tiny" and cards["beta"]["parent"] == "tiny"
    assert cards["alpha"]["root"] == str(root / "alpha")
    assert cards["tiny"].get("parent") is None
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'fornax:lora_requests_total{adapter="alpha",model_name="tiny"}' in metrics
    assert 'fornax:lora_adapter_loads_total{adapter="beta",model_name="tiny"} 1.0' in metrics


def test_the_event_stream_names_a_requests_adapter(setup):
    """The visualizer's request view shows the adapter from the `queued` event (server/ui/app.js)."""
    server, client, _hf, _root = setup
    events: list[dict] = []
    opened = threading.Event()

    def watch() -> None:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.stream("GET", server.url + "/v1/fornax/events", headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                opened.set()
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if sum(e["type"] == "finished" for e in events) >= 2:
                        return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert opened.wait(30)
    adapted = client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    watcher.join(timeout=60)
    queued = {e["request_id"]: e for e in events if e["type"] == "queued"}
    assert queued[adapted.id]["adapter"] == "beta"
    assert "adapter" not in queued[base.id]


def test_load_and_unload_at_run_time_need_an_admin_key(setup):
    server, client, hf, root = setup
    body = {"lora_name": "gamma", "lora_path": str(root / "gamma")}
    denied = _admin(server, "/v1/load_lora_adapter", body, key=USER)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=1)
    loaded = _admin(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert _tokens(client, "gamma") == _expected(hf, root, "gamma")
    again = _admin(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
    assert _admin(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=1)
    gone = _admin(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"


def test_a_bad_adapter_is_a_400_with_the_reason_and_changes_nothing(setup, tmp_path):
    server, client, _hf, root = setup
    before = sorted(m.id for m in client.models.list().data)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((root / "gamma" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))  # over --max-lora-rank 16
    (bad / "adapter_model.safetensors").write_bytes(
        (root / "gamma" / "adapter_model.safetensors").read_bytes()
    )
    r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "over this server's limit of 16" in r.json()["error"]["message"]
    r = _admin(server, "/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    assert sorted(m.id for m in client.models.list().data) == before
    assert _tokens(client, "alpha") == _tokens(client, "alpha")  # still serving


def test_requests_run_on_while_adapters_load_and_unload_over_one_slot(setup):
    server, client, hf, root = setup
    expected = {name: _expected(hf, root, name) for name in ("alpha", "beta", None)}
    assert len(set(expected.values())) == 3  # each adapter writes its own text

    def run(name: str | None) -> tuple[str | None, str]:
        return name, _tokens(client, name or "tiny")

    names = ["alpha", "beta", None] * 4  # two adapters over one slot: they take turns
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, n) for n in names]
        body = {"lora_name": "gamma", "lora_path": str(root / "gamma")}
        assert _admin(server, "/v1/load_lora_adapter", body).status_code == 200
        assert _admin(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
        results = [f.result(timeout=120) for f in futures]
    for name, tokens in results:
        assert tokens == expected[name], name
    server.assert_idle()
