"""A real `fornax serve` subprocess on a free loopback port, one per test module (the launcher
is the benchmarks' own, benchmarks/_servers.py)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks._servers import FornaxProcess


class ServerProcess(FornaxProcess):
    """`fornax serve ARGS` for a test: only the keys the test asks for (the environment's are
    dropped), a shared FORNAX_HOME, and the engine's state read through /admin/state."""

    admin_key: str | None = None  # what /admin/* is called with (make_server sets it)

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str | None] | None = None,
        api_key: str | None = None,
        bootstrap: str | None = None,
        port: int | None = None,
    ) -> None:
        self.api_key = api_key
        full_env = {**os.environ, "FORNAX_HOME": os.environ.get("FORNAX_HOME", "/tmp/fhome"), **(env or {})}
        if "FORNAX_API_KEY" not in (env or {}):
            full_env.pop("FORNAX_API_KEY", None)  # only the keys a test asks for
        if "FORNAX_ADMIN_KEY" not in (env or {}):
            full_env.pop("FORNAX_ADMIN_KEY", None)
        full = {k: v for k, v in full_env.items() if v is not None}  # None: unset for this server
        # A given port: a restart where the last one listened.
        super().__init__("fornax serve", ["serve", *args], log_path, full, port=port, bootstrap=bootstrap)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else self.headers

    def state(self) -> dict:
        r = httpx.get(self.url + "/admin/state", headers=self.admin_headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Wait until no request runs, waits or holds KV blocks; the last state seen."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while time.monotonic() < deadline:
            state = self.state()
            engines = [m for m in state["models"] if m["loaded"]]  # every model's, when several
            if state["inflight_requests"] == 0 and all(
                m["num_running"] == 0
                and m["num_waiting"] == 0
                and m["kv_cache_usage"] == 0
                and m["engine_streams"] == 0
                for m in engines
            ):
                break
            time.sleep(0.05)
        return state

    def assert_idle(self) -> None:
        state = self.wait_idle()
        assert state["inflight_requests"] == 0, state
        for m in (m for m in state["models"] if m["loaded"]):
            assert m["num_running"] == 0 and m["num_waiting"] == 0, state
            assert m["kv_cache_usage"] == 0, state
            assert m["engine_streams"] == 0 and m["kv_integrity"] == "ok", state

    def log(self) -> str:
        self._log.flush()
        return self.log_tail()


FIXTURE_ADMIN_KEY = "sk-fixture-admin"


def _admin_key(args: list[str]) -> str | None:
    """The key of the first `--admin-key [name:]key` among a server's arguments."""
    for flag, value in itertools.pairwise(args):
        if flag == "--admin-key":
            return value.partition(":")[2] or value
    return None


@pytest.fixture(scope="module")
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers for one module; each is checked idle (KV usage 0) and stopped at the end."""
    started: list[ServerProcess] = []

    def make(
        args: list[str],
        env: dict[str, str | None] | None = None,
        api_key: str | None = None,
        wait: bool = True,
        bootstrap: str | None = None,
    ) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        # /admin/* needs an admin key once keys are on: a server with a user key also gets one
        # (unless the test gives its own), so the fixture can check it idle.
        admin_key = _admin_key(args)
        if api_key is not None and admin_key is None:
            admin_key = FIXTURE_ADMIN_KEY
            args = [*args, "--admin-key", f"fixture-admin:{admin_key}"]
        server = ServerProcess(args, log, env, api_key, bootstrap)
        server.admin_key = admin_key
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield make
    errors = []
    for server in started:
        try:
            if server.proc.poll() is None:
                server.assert_idle()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            server.stop()
    assert not errors, errors
