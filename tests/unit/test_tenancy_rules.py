"""Roles, key loading, cache salts and what a user may see, without a model (in-process)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from fornax.config import ConfigError, EngineConfig, RateLimit, ServerConfig, load_admin_keys, load_key_limits
from fornax.engine.events import Event
from fornax.server.app import create_app
from fornax.server.auth import KeyStore
from fornax.server.tenancy import Tenancy, Viewer, log_tenancy

USERS = (("alice", "ka"), ("bob", "kb"))
ADMINS = (("ops", "ko"),)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_carry_roles_and_an_open_server_is_admin() -> None:
    keys = KeyStore(USERS, ADMINS)
    assert keys.identify("Bearer ka") == ("alice", "user")
    assert keys.identify("Bearer ko") == ("ops", "admin")
    assert keys.identify("Bearer kx") is None and keys.identify(None) is None
    assert KeyStore(()).identify(None) == ("anonymous", "admin")


def test_admin_routes_are_for_admin_keys_only() -> None:
    # No lifespan: the model is never loaded, and /admin/usage does not need it.
    app = TestClient(create_app(ServerConfig(api_keys=USERS, admin_keys=ADMINS), EngineConfig()))
    r = app.get("/admin/usage", headers=bearer("ka"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert r.json()["error"]["type"] == "permission_error"
    assert app.get("/admin/usage", headers=bearer("ko")).status_code == 200
    assert app.get("/admin/usage", headers=bearer("nope")).status_code == 401
    # Keys but no admin key: /admin/* is closed to everyone; with no keys at all it is open.
    users_only = TestClient(create_app(ServerConfig(api_keys=USERS), EngineConfig()))
    assert users_only.get("/admin/usage", headers=bearer("ka")).status_code == 403
    assert TestClient(create_app(ServerConfig(), EngineConfig())).get("/admin/usage").status_code == 200


def test_startup_says_when_admin_routes_are_closed(caplog) -> None:
    logger = logging.getLogger("test.tenancy")
    with caplog.at_level(logging.INFO, logger="test.tenancy"):
        log_tenancy(ServerConfig(api_keys=USERS), logger)
    assert "no admin key configured: /admin/* answers 403" in caplog.text
    assert "2 user key(s), 0 admin key(s); prefix cache scope: key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test.tenancy"):
        log_tenancy(ServerConfig(api_keys=USERS, admin_keys=ADMINS), logger)
    assert "no admin key" not in caplog.text and "1 admin key(s)" in caplog.text


def test_admin_keys_come_from_flags_env_and_file(tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "admins.txt"
    key_file.write_text("# operators\nops2:k2\nk3\n")
    monkeypatch.setenv("FORNAX_ADMIN_KEY", "k4")
    keys = load_admin_keys(["ops:k1"], str(key_file))
    assert keys == (("ops", "k1"), ("admin-2", "k4"), ("ops2", "k2"), ("admin-4", "k3"))


def test_config_rejects_a_name_or_secret_in_both_roles_and_resolves_the_scope() -> None:
    with pytest.raises(ConfigError, match="both"):
        ServerConfig(api_keys=(("ops", "ka"),), admin_keys=ADMINS)
    with pytest.raises(ConfigError, match="same secret"):
        ServerConfig(api_keys=(("alice", "ko"),), admin_keys=ADMINS)
    assert ServerConfig().prefix_cache_scope == "global"
    assert ServerConfig(api_keys=USERS).prefix_cache_scope == "key"
    assert ServerConfig(admin_keys=ADMINS).prefix_cache_scope == "key"
    assert ServerConfig(api_keys=USERS, prefix_cache_scope="global").prefix_cache_scope == "global"
    with pytest.raises(ConfigError, match="prefix_cache_scope"):
        ServerConfig(prefix_cache_scope="tenant")
    with pytest.raises(ConfigError, match="unknown key"):
        ServerConfig(api_keys=USERS, rate_limits=(("alcie", RateLimit(requests_per_minute=1)),))


def test_key_limits_file_defaults_and_flags(tmp_path) -> None:
    path = tmp_path / "limits.json"
    path.write_text(
        json.dumps(
            {
                "alice": {"requests_per_minute": 5},
                "ops": {"tokens_per_minute": None},
                "*": {"requests_per_minute": 60, "tokens_per_minute": 1000},
            }
        )
    )
    limits = dict(load_key_limits(str(path)))
    assert limits["*"] == RateLimit(60, 1000)
    assert limits["alice"] == RateLimit(5, 1000)  # its own field over the default's
    assert limits["ops"] == RateLimit(60, None)  # null: unlimited
    limits = dict(load_key_limits(str(path), tokens_per_minute=500))  # the flag overrides "*"
    assert limits["*"] == RateLimit(60, 500) and limits["alice"] == RateLimit(5, 500)
    assert load_key_limits() == ()
    assert dict(load_key_limits(None, 10)) == {"*": RateLimit(10, None)}
    path.write_text(json.dumps({"alice": {"rpm": 5}}))
    with pytest.raises(ConfigError, match="unknown field"):
        load_key_limits(str(path))
    path.write_text(json.dumps({"alice": {"requests_per_minute": 0}}))
    with pytest.raises(ConfigError, match="positive"):
        load_key_limits(str(path))


def test_cache_salt_by_scope() -> None:
    keyed = Tenancy(ServerConfig(api_keys=USERS))
    assert keyed.cache_salt("alice", None) != keyed.cache_salt("bob", None)
    assert keyed.cache_salt("alice", "x") not in (
        keyed.cache_salt("alice", None),
        keyed.cache_salt("bob", "x"),
    )
    # A key name and a client salt cannot be combined to imitate another pair.
    assert keyed.cache_salt("a", "b:c") != keyed.cache_salt("a:b", "c")
    shared = Tenancy(ServerConfig(api_keys=USERS, prefix_cache_scope="global"))
    assert shared.cache_salt("alice", None) is None and shared.cache_salt("bob", None) is None
    assert shared.cache_salt("alice", "x") == shared.cache_salt("bob", "x") != shared.cache_salt("bob", "y")


def test_users_see_only_their_own_requests() -> None:
    tenancy = Tenancy(ServerConfig(api_keys=USERS, admin_keys=ADMINS))
    tenancy.claim(["a1"], "alice")
    tenancy.claim(["b1"], "bob")
    alice, ops = Viewer("alice", admin=False), Viewer("ops", admin=True)
    token = Event("token", "b1", 0.0, {"text": "bob's secret"})
    assert tenancy.event_for(alice, token) is None
    assert tenancy.event_for(ops, token)["text"] == "bob's secret"
    sched = Event("scheduled", "a1", 0.0, {"batch": ["b1", "a-unknown"], "batch_size": 3})
    assert (
        tenancy.event_for(alice, sched)["batch"] == [] and tenancy.event_for(alice, sched)["batch_size"] == 3
    )
    assert tenancy.event_for(ops, sched)["batch"] == ["b1", "a-unknown"]
    assert tenancy.event_for(alice, Event("token", "never-seen", 0.0)) is None  # unknown ids: fail closed
    snap = {
        "num_running": 2,
        "running": [{"request_id": "a1"}, {"request_id": "b1"}],
        "num_waiting": 1,
        "waiting": [{"request_id": "b1"}],
    }
    mine = tenancy.snapshot_for(alice, snap)
    assert mine["running"] == [{"request_id": "a1"}] and mine["waiting"] == [] and mine["num_running"] == 2
    assert tenancy.snapshot_for(ops, snap) == snap
    assert tenancy.may_see(alice, "a1") and not tenancy.may_see(alice, "b1") and tenancy.may_see(ops, "b1")


def test_owners_forget_the_oldest_first() -> None:
    tenancy = Tenancy(ServerConfig(api_keys=USERS))
    tenancy.owners.capacity = 3
    for i in range(5):
        tenancy.claim([f"r{i}"], "alice")
    alice = Viewer("alice", admin=False)
    assert [tenancy.may_see(alice, f"r{i}") for i in range(5)] == [False, False, True, True, True]
