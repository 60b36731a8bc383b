"""The fault campaign's generated half: schemathesis reads the live server's /openapi.json
and sends a bounded number of generated requests to every public route, with an admin key,
with a user key and with none. No answer may be a 5xx, every error must be its route's
envelope (Anthropic's on /v1/messages*, OpenAI's elsewhere), and afterwards the server must be
healthy and idle (no KV block held: the `make_server` fixture checks that when the module ends).

The two event streams (/v1/fornax/events, and /v1/fornax/live without once=true) never end
by design, so they are left to tests/server/test_tenancy.py.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from fornax.server.auth import ADMIN_PATHS

pytestmark = pytest.mark.slow
KEYS = {"admin": "sk-campaign-admin", "user": "sk-campaign-user", "none": None}
MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def server(make_server):
    # Small bounds so that generated requests stay cheap: a short context, 4 tokens at most; LoRA
    # slots, so that generated adapter loads reach the loader's checks.
    return make_server(
        [
            "--api-key",
            f"user:{KEYS['user']}",
            "--admin-key",
            f"ops:{KEYS['admin']}",
            "--max-model-len",
            "128",
            "--max-tokens-limit",
            "4",
            "--max-n",
            "2",
            "--max-prompts",
            "4",
            "--no-access-log",
            "--enable-lora",
        ],
        api_key=KEYS["admin"],
    )


def _openapi_document() -> dict:
    """The document the server serves, built in-process so operations are known at collection."""
    from fornax.config import EngineConfig, ServerConfig
    from fornax.server.app import create_app

    return create_app(ServerConfig(), EngineConfig()).openapi()


SCHEMA = schemathesis.openapi.from_dict(_openapi_document())
OPERATIONS = [
    (path, method.upper())
    for path, item in SCHEMA.raw_schema["paths"].items()
    for method in item
    if path not in ("/v1/fornax/events", "/v1/fornax/live")
]


def test_the_served_document_is_the_one_tested(server) -> None:
    served = httpx.get(server.url + "/openapi.json", timeout=10)  # public: it holds no data
    assert served.status_code == 200
    assert sorted(served.json()["paths"]) == sorted(SCHEMA.raw_schema["paths"])


def assert_envelope(response: object, where: str, path: str) -> None:
    body = response.json()
    if path.startswith("/v1/messages"):  # Anthropic's Messages API: its own envelope
        assert isinstance(body, dict) and body.get("type") == "error", where
        error = body.get("error")
        assert isinstance(error, dict) and set(error) == {"type", "message"} and error["message"], where
        return
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), where
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], where


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_generated_requests_never_get_a_5xx(server, path: str, method: str) -> None:
    operation = SCHEMA[path][method]
    statuses: list[int] = []  # the admin's: generated requests must reach the route itself

    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def campaign(case) -> None:
        for role, key in KEYS.items():
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = case.call(base_url=server.url, headers=headers, timeout=60)
            where = f"{role}: {method} {path} {str(case.body)[:200]!r} -> {response.status_code} {response.text[:300]}"
            if role == "admin":
                statuses.append(response.status_code)
            assert response.status_code < 500, where
            if response.status_code >= 400:
                assert_envelope(response, where, path)
            if key is None and path not in ("/health", "/openapi.json"):
                assert response.status_code == 401, where
            if role == "user" and (path.startswith("/admin/") or path in ADMIN_PATHS):
                assert response.status_code == 403, where

    campaign()
    print(f"{method} {path}: admin statuses {sorted(set(statuses))} over {len(statuses)} cases")
    assert statuses and any(status != 401 for status in statuses)


def test_the_server_is_healthy_afterwards(server) -> None:
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    server.assert_idle()
