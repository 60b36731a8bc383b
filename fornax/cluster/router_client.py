"""The router, from the controller's side: a `fornax router` subprocess and its membership
routes over HTTP (GET/POST/DELETE /router/replicas with the admin key).

`Membership` is all the controller needs, so tests can stand in for the router where it
does not matter, and another front door could be plugged in.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Protocol

import httpx

from fornax.cluster.membership import normalize


class Membership(Protocol):
    def members(self) -> set[str]: ...

    def add(self, url: str, tags: Mapping[str, str]) -> None: ...

    def remove(self, url: str) -> None: ...


class RouterClient:
    """Membership over the router's admin routes."""

    def __init__(self, base_url: str, admin_key: str | None, timeout_s: float = 5.0) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def replicas(self) -> list[dict]:
        r = self._http.get("/router/replicas")
        r.raise_for_status()
        body = r.json()
        # {"object": "list", "data": [...], "draining": [...]}: removed ones still draining
        # are not members (they get no new requests).
        return list(body["data"]) if isinstance(body, dict) else list(body)

    def members(self) -> set[str]:
        return {normalize(item["url"]) for item in self.replicas()}

    def add(self, url: str, tags: Mapping[str, str]) -> None:
        self._http.post("/router/replicas", json={"url": url, "tags": dict(tags)}).raise_for_status()

    def remove(self, url: str) -> None:
        r = self._http.request("DELETE", "/router/replicas", json={"url": url})
        if r.status_code != 404:  # already gone is what we wanted
            r.raise_for_status()

    def close(self) -> None:
        self._http.close()


class RouterProcess:
    """`python -m fornax.cli router ...` in its own session: a Ctrl-C at the controller's
    terminal does not reach it, so it stops after the replicas have drained, not before.
    The main CLI loads neither torch nor the model modules for `router` (~0.1 s to parse
    its flags, ~57 MB when serving), the same as `python -m fornax.router`."""

    def __init__(self, host: str, port: int, args: list[str]) -> None:
        self.url = f"http://{host}:{port}"
        self.command = [
            sys.executable,
            "-m",
            "fornax.cli",
            "router",
            "--host",
            host,
            "--port",
            str(port),
            *args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, start_new_session=True)

    def wait_ready(self, client: RouterClient, timeout_s: float) -> None:
        """Until its membership route answers (it has none of our replicas yet)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"fornax router exited with {self.proc.returncode} at start")
            try:
                client.replicas()
                return
            except httpx.HTTPStatusError as exc:  # it answers, and says no: waiting will not help
                status = exc.response.status_code
                raise RuntimeError(f"fornax router refused the controller: {status}") from exc
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"fornax router not ready after {timeout_s:g}s")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
