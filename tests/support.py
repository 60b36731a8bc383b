"""Helpers the tests share: a free loopback port, and `make run`'s serving flags read from the
Makefile itself, so the tests that claim to serve make run's forms serve exactly them."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port no one listens on now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_run_flags() -> tuple[str, ...]:
    """The flags after `fornax serve $(MODEL) --host $(HOST) --port $(PORT)` in the run target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("run:")))
    serve = next(line for line in lines[start:] if "fornax serve" in line)
    words = shlex.split(serve.split("fornax serve", 1)[1])
    flags = [w for w in words if not w.startswith("$(")]
    own = {"--host", "--port"}
    return tuple(w for i, w in enumerate(flags) if w not in own)


MAKE_RUN_FLAGS = _make_run_flags()
