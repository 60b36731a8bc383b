"""`fornax` server processes for the benchmarks that drive real servers over HTTP."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """Any HTTP server child (`cmd`, already given its loopback `port`), its output in a log file."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(
        self, ready: Any = lambda r: r.status_code == 200, timeout_s: float = READY_TIMEOUT_S
    ) -> None:
        """Until `ready(httpx response of GET /health)` holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if ready(httpx.get(self.url + "/health", timeout=2.0)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Process(ServerProcess):
    """A `python -m fornax.cli ...` child on a free loopback port."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "fornax.cli", *args, "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(name, cmd, port, log_dir / f"{name}-{port}.log")
