"""`python -m fornax.router ...`: the same flags as `fornax router`, without importing the
model modules (`fornax.cli` loads torch to report model errors), so the router starts in
well under a second and stays small."""

from __future__ import annotations

import argparse
import sys

from fornax.config import ConfigError
from fornax.router.cli import add_router_parser, cmd_router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fornax")  # usage reads "fornax router ..."
    sub = parser.add_subparsers(dest="command", required=True)
    add_router_parser(sub)
    args = parser.parse_args(["router", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_router(args)
    except ConfigError as exc:
        print(f"fornax router: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
