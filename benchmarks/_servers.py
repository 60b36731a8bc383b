"""Server processes on loopback ports, for the benchmarks that drive real servers over HTTP and
for the tests (tests/server/conftest.py builds on `FornaxProcess`): one launcher, one way to wait
for readiness and to stop, and `make run`'s serving flags read from the Makefile itself.

The benchmarks run as scripts (`python benchmarks/x.py`: this directory is on sys.path, so
`from _servers import ...`); the tests and the soak test import it as `benchmarks._servers`.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    """A loopback port no one listens on now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_run_flags() -> tuple[str, ...]:
    """The flags after `fornax serve $(MODEL) --host $(HOST) --port $(PORT)` in the run target, so
    whatever claims to serve make run's forms serves exactly them."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("run:")))
    serve = next(line for line in lines[start:] if "fornax serve" in line)
    words = shlex.split(serve.split("fornax serve", 1)[1])
    flags = [w for w in words if not w.startswith("$(")]
    own = {"--host", "--port"}
    return tuple(w for w in flags if w not in own)


MAKE_RUN_FLAGS = _make_run_flags()


def _healthy(response: httpx.Response) -> bool:
    return response.status_code == 200


class ServerProcess:
    """Any HTTP server child (`cmd`, already given its loopback `port`), its output in a log file
    that stays open until `stop()`."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        with contextlib.ExitStack() as files:  # pop_all() hands the log over once the child runs
            self._log = files.enter_context(open(log_path, "wb"))
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
            self._files = files.pop_all()

    def health_status(self) -> int | None:
        """GET /health's status, None when nothing answers."""
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(
        self, ready: Callable[[httpx.Response], bool] = _healthy, timeout_s: float = READY_TIMEOUT_S
    ) -> list[int | None]:
        """Poll GET /health until `ready(response)` holds; the statuses seen on the way (None:
        nothing answered yet)."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2.0)
            except httpx.HTTPError:
                seen.append(None)
            else:
                seen.append(response.status_code)
                if ready(response):
                    return seen
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 5000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a fornax server drains), killed if it does not exit in time; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._files.close()
        return int(self.proc.returncode)


class FornaxProcess(ServerProcess):
    """`fornax ARGS --host 127.0.0.1 --port P` as a child process on a free loopback port (or the
    given one: a restart where the last one listened). `bootstrap`: Python run in the child
    before the CLI (the tests' fault injection)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        bootstrap: str | None = None,
    ) -> None:
        port = port or free_port()
        entry = ["-m", "fornax.cli"] if bootstrap is None else ["-c", f"{bootstrap}\n{_RUN_CLI}"]
        self.args = args
        cmd = [sys.executable, *entry, *args, "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(name, cmd, port, log_path, env)


_RUN_CLI = "import sys\nfrom fornax.cli import main\nsys.exit(main(sys.argv[1:]))"


class Process(FornaxProcess):
    """A benchmark's fornax child, its log in `log_dir` named by its name and port."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        port = free_port()
        super().__init__(name, args, log_dir / f"{name}-{port}.log", port=port)
