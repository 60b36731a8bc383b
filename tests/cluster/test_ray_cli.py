"""`fornax cluster up` as a user runs it (slow): a keyed cluster of one replica on its own Ray
runtime, serving through the router, then SIGTERM: the request in flight finishes, the
process exits 0, and nothing it started is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fornax.cluster.process import free_port

pytest.importorskip("ray", reason="Ray is not installed (pip install 'fornax[cluster]')")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_turn"),
]  # one Ray runtime at a time (conftest.py)
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
KEY = "sk-cluster-test"


def _leftovers(port: int) -> list[str]:
    patterns = ["fornax.cluster.child", f"fornax.cli router --host 127.0.0.1 --port {port}"]
    out = [
        subprocess.run(["pgrep", "-af", p], check=False, capture_output=True, text=True).stdout
        for p in patterns
    ]
    return [line for text in out for line in text.splitlines() if "pgrep" not in line]


def test_cluster_up_serves_with_keys_and_drains_on_sigterm(tmp_path: Path) -> None:
    port, log_path = free_port("127.0.0.1"), tmp_path / "cluster.log"
    before = set(_leftovers(port))
    env = {**os.environ, "FORNAX_HOME": os.environ.get("FORNAX_HOME", "/tmp/fhome")}
    cmd = [
        sys.executable,
        "-m",
        "fornax.cli",
        "cluster",
        "up",
        MODEL,
        "--replicas",
        "1",
        "--threads-per-replica",
        "1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--api-key",
        f"tester:{KEY}",
        "--no-access-log",
        "--shutdown-timeout",
        "20",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while b"Ctrl-C to drain" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 120}  # seconds of decoding
        assert (
            httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        )  # the router's keys
        replicas = httpx.get(url + "/router/replicas", headers=auth, timeout=10)
        assert replicas.status_code == 403  # a user key is no admin: only the controller's own key is
        models = httpx.get(url + "/v1/models", headers=auth, timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # polled from the keyed replica with the poll key
        results: list[int] = []
        slow = threading.Thread(
            target=lambda: results.append(
                httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=120).status_code
            )
        )
        slow.start()
        time.sleep(1.0)  # in flight on the replica
        proc.send_signal(signal.SIGTERM)
        slow.join(timeout=120)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        assert results == [200], log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while set(_leftovers(port)) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_leftovers(port)) - before
