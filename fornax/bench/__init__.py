"""Load generator and report for any OpenAI-compatible server (`fornax bench serve`).

Talks HTTP only: nothing here imports the engine, so it measures fornax and other servers alike.
The CLI hooks are `fornax.bench.cli.add_bench_parser` and `fornax.bench.cli.run_bench`; they are
re-exported lazily so `python -m fornax.bench.cli` does not import the module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_bench_parser", "run_bench"]


class BenchUsageError(ValueError):
    """A bad `fornax bench` argument: told as one line by the CLI, never a traceback."""


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fornax.bench import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'fornax.bench' has no attribute {name!r}")
