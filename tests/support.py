"""Helpers the tests share: a free loopback port, and `make run`'s serving flags read from the
Makefile itself, so the tests that claim to serve make run's forms serve exactly them (both
kept beside the server launcher the benchmarks and tests share: benchmarks/_servers.py)."""

from __future__ import annotations

from benchmarks._servers import MAKE_RUN_FLAGS, ROOT, free_port

__all__ = ["MAKE_RUN_FLAGS", "ROOT", "free_port"]
