"""The engine thread must be the only live thread of the server that has run OpenMP work.

GNU OpenMP keeps a team of worker threads for every thread that has started a parallel
region, as long as that thread lives, and when it manages more threads than there are CPUs
its barriers sleep in the kernel instead of spinning. The model load once ran in an
executor thread that lived on, and every barrier of every step (hundreds per step) became a
futex sleep and wake: a one-row step 4-5x slower on 2 CPUs (server/app.py). Timing would be
a flaky witness on a shared machine; the context switches it causes are not.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import MAKE_RUN_FLAGS

PROC = Path("/proc")

TOKENS = 48


def voluntary_switches(pid: int) -> int:
    """Voluntary context switches of all the process's live threads."""
    total = 0
    for status in (PROC / str(pid) / "task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        total += sum(int(ln.split()[1]) for ln in lines if ln.startswith("voluntary_ctxt_switches:"))
    return total


@pytest.mark.skipif(not (PROC / "self" / "task").is_dir(), reason="needs Linux /proc")
def test_decode_steps_do_not_sleep_at_openmp_barriers(make_server) -> None:
    # make run's weights: the one-call step and the int8 kernels, all OpenMP.
    # OpenMP's default waiting, as a user's server has it (make test sets OMP_WAIT_POLICY=PASSIVE,
    # under which every barrier sleeps by design)
    server = make_server([*MAKE_RUN_FLAGS, "--no-access-log"], env={"OMP_WAIT_POLICY": None})
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": "The harbour town woke slowly.",
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()  # first-use costs
    before = voluntary_switches(server.proc.pid)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    switches = voluntary_switches(server.proc.pid) - before
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == TOKENS
    # A step sleeps a few times (waiting for work, handing outputs to the event loop); with a
    # second OpenMP team alive it was ~hundreds per step.
    assert switches / TOKENS < 25, f"{switches} voluntary context switches for {TOKENS} decode steps"
