"""`python -m fornax.router ...`: the same as `fornax router ...` (same flags, same one-line
errors). Kept for scripts that use it; the main CLI no longer imports the model modules
(torch) for `router`, so both start equally fast and stay equally small."""

from __future__ import annotations

import sys

from fornax.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["router", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
