"""The Ray tests take turns: `make test` runs test files on several pytest-xdist workers, and two
local Ray runtimes starting at once (dozens of processes each) would fight over the cores for
their start-up timeouts. Each Ray test module holds an exclusive lock on one file while it runs."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

RAY_LOCK = Path("/tmp/fornax-tests-ray.lock")


@pytest.fixture(scope="module")
def ray_turn() -> Iterator[None]:
    with open(RAY_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
