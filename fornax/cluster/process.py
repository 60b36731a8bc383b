"""One `fornax serve` subprocess, as a replica's actor runs it; plain Python, no Ray.

The server is started through fornax.cluster.child, so it exits when the actor's process
does (see there why), in its own session, so a Ctrl-C at the controller's terminal does not
reach it: the controller drains replicas in its own order (router first).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fornax.cluster.autoscaler import Load
from fornax.cluster.config import ReplicaSpec

WAITING_METRIC = "fornax:num_requests_waiting"  # fornax/metrics/prometheus.py
RUNNING_METRIC = "fornax:num_requests_running"
KILL_MARGIN_S = 10.0  # past the shutdown timeout: uvicorn's own exit and the model's teardown


def free_port(host: str) -> int:
    """A port free now; the server binds it a moment later (a lost race fails its start, and
    Ray restarts the actor on another port)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_load(text: str) -> Load:
    """The two engine gauges from Prometheus text, summed over label sets (one per model name)."""
    totals = {WAITING_METRIC: 0.0, RUNNING_METRIC: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(sample.value for sample in family.samples)
    return Load(waiting=totals[WAITING_METRIC], running=totals[RUNNING_METRIC])


class ReplicaProcess:
    def __init__(self, spec: ReplicaSpec, host: str) -> None:
        self.spec = spec
        self.host = host
        self.port = free_port(host)
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._headers = {"Authorization": f"Bearer {spec.metrics_key}"} if spec.metrics_key else {}

    def command(self) -> list[str]:
        spec = self.spec
        grace = spec.shutdown_timeout_s + KILL_MARGIN_S
        # The actor's flags come last: argparse keeps the last value, so they win over a pass-through.
        return [
            sys.executable,
            "-m",
            "fornax.cluster.child",
            str(os.getpid()),
            str(grace),
            "serve",
            spec.model,
            *spec.serve_args,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--num-threads",
            str(spec.num_threads),
            "--shutdown-timeout",
            str(spec.shutdown_timeout_s),
        ]

    def start(self) -> None:
        env = {**os.environ, **dict(self.spec.env)}
        # stdout/stderr are the actor's: Ray writes them to its logs and shows them at the driver.
        self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def health(self) -> int | None:
        """/health's status; None when nothing answers."""
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code
        except httpx.HTTPError:
            return None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise RuntimeError(f"fornax serve exited with {code} before it was ready")
            if self.health() == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"fornax serve not ready after {timeout_s:g}s")

    def load(self) -> Load:
        r = httpx.get(self.url + "/metrics", headers=self._headers, timeout=5.0)
        r.raise_for_status()
        return parse_load(r.text)

    def drain(self) -> int | None:
        """SIGTERM: the server answers what it has (new requests get 503) and exits; killed if
        it has not within its shutdown timeout plus a margin. The exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=self.spec.shutdown_timeout_s + KILL_MARGIN_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
