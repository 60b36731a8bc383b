"""`python -m fornax.cluster.child PARENT_PID GRACE_S ARGS...`: `fornax ARGS...` that dies with
its parent (the replica's Ray actor).

Why a watchdog thread and not prctl(PR_SET_PDEATHSIG): that is Linux-only, fires when the
*thread* that forked exits (not the process), and has to be set in a preexec_fn, which
CPython warns is unsafe in a process with threads (a Ray worker has many). Here the child
checks its parent pid twice a second: once the actor is gone (killed, crashed, Ray shut down)
it is reparented, and it sends itself SIGTERM, so the server drains what it still has, as on
a scale-down; if it has not exited GRACE_S later, it exits hard. The pid is compared with
the one the actor passed, which also covers a parent that died before this process started.
(Ray also kills a dead worker's children where it can; this is the guarantee, not the hope.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 0.5


def _watch_parent(parent_pid: int, grace_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the server's own drain, run by its main thread
    time.sleep(grace_s)
    os._exit(1)  # the drain hung: nothing else will end this process


def main(argv: list[str]) -> int:
    parent_pid, grace_s, cli_args = int(argv[0]), float(argv[1]), argv[2:]
    watchdog = threading.Thread(target=_watch_parent, args=(parent_pid, grace_s), name="parent-watchdog")
    watchdog.daemon = True  # it must not keep a finished server alive
    watchdog.start()
    from fornax.cli import main as fornax_main

    return fornax_main(cli_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
