"""A replica's server dies with its actor: the child's parent watchdog (no Ray, no model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The grandchild: the watchdog of fornax.cluster.child, and a SIGTERM handler standing in for
# the server's drain (it records the signal, then exits).
GRANDCHILD = """
import signal, sys, threading, time
from fornax.cluster import child
def drain(signum, frame):
    open(sys.argv[2], "w").write("drained")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
threading.Thread(target=child._watch_parent, args=(int(sys.argv[1]), 30.0), daemon=True).start()
time.sleep(60)
"""
# The parent (the actor): starts the grandchild, says its pid, then waits to be killed.
PARENT = """
import os, subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
print(p.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # exited; waiting for init to reap it


def test_the_server_drains_and_exits_when_its_actor_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "drained"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, GRANDCHILD, str(marker)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    try:
        time.sleep(1.0)  # the grandchild is up and watching
        assert not _gone(grandchild)
        parent.send_signal(signal.SIGKILL)  # as ray.kill does to the actor's worker
        parent.wait()
        deadline = time.monotonic() + 5
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(grandchild), "the child outlived its parent"
        assert marker.read_text() == "drained"  # it got SIGTERM (a drain), not a silent kill
    finally:
        if not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)
