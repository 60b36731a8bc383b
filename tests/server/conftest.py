"""A real `fornax serve` subprocess on a free loopback port, one per test module."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


_RUN_CLI = "import sys\nfrom fornax.cli import main\nsys.exit(main(sys.argv[1:]))"


class ServerProcess:
    admin_key: str | None = None  # what /admin/* is called with (make_server sets it)

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str | None] | None = None,
                 api_key: str | None = None, bootstrap: str | None = None,
                 port: int | None = None) -> None:  # fmt: skip
        self.port = port or free_port()  # a given port: a restart where the last one listened
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        full_env = {**os.environ, "FORNAX_HOME": os.environ.get("FORNAX_HOME", "/tmp/fhome"), **(env or {})}
        if "FORNAX_API_KEY" not in (env or {}):
            full_env.pop("FORNAX_API_KEY", None)  # only the keys a test asks for
        if "FORNAX_ADMIN_KEY" not in (env or {}):
            full_env.pop("FORNAX_ADMIN_KEY", None)
        full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset for this server
        # `bootstrap`: Python run in the server process before the CLI (fault-injection tests).
        entry = ["-m", "fornax.cli"] if bootstrap is None else ["-c", f"{bootstrap}\n{_RUN_CLI}"]
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), "--host", "127.0.0.1", *args]
        # The log stays open until stop(): pop_all() hands it over once the server has started.
        with contextlib.ExitStack() as files:
            self._log = files.enter_context(open(log_path, "wb"))
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
            )
            self._files = files.pop_all()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else self.headers

    def health_status(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 180.0) -> list[int | None]:
        """Poll /health until 200; the statuses seen on the way."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            status = self.health_status()
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

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
                m["num_running"] == 0 and m["num_waiting"] == 0 and m["kv_cache_usage"] == 0
                and m["engine_streams"] == 0 for m in engines
            ):  # fmt: skip
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
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._files.close()
        return self.proc.returncode


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

    def make(args: list[str], env: dict[str, str | None] | None = None, api_key: str | None = None,
             wait: bool = True, bootstrap: str | None = None) -> ServerProcess:  # fmt: skip
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
