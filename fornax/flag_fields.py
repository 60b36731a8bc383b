"""Dataclass fields that carry their command-line flag: one declaration gives the field, its
flag, its help and the way a value is written back as argv.

EngineArgs (engine_args.py) and ServerArgs (server_args.py) are built from these, so a
setting is declared once: the parser is made from the fields (`add_fields`), a namespace is
read back into them, and `as_argv` renders the settings that differ from the defaults as a
command line the same parser reads back to the same values (the cluster starts its replicas
with it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import Field, field, fields
from typing import Any


def flag_field(
    default: Any, help: str | None, *, group: str, flags: tuple[str, ...] = (), **argparse_kwargs: Any
) -> Any:
    """A field with its flag's spelling (default: --field-name), help, argument group and any
    other add_argument keyword (type, choices, action, metavar)."""
    return field(
        default=default, metadata={"help": help, "group": group, "flags": flags, "argparse": argparse_kwargs}
    )


def flags_of(f: Field[Any]) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def add_fields(
    cls: type,
    parser: argparse.ArgumentParser,
    *,
    own_group: str,
    groups: tuple[str, ...],
    exclude: tuple[str, ...] = (),
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Add a flag for each field of `cls` in `groups` (less `exclude`): those of `own_group` on
    the parser's own options, the others in an argument group each, made on first use."""
    containers: dict[str, Any] = {own_group: parser}
    for f in fields(cls):
        group = f.metadata["group"]
        if group not in groups or f.name in exclude:
            continue
        if group not in containers:
            containers[group] = parser.add_argument_group(group)
        kwargs = {"default": f.default, "help": f.metadata["help"], **f.metadata["argparse"]}
        kwargs |= (overrides or {}).get(f.name, {})
        containers[group].add_argument(*flags_of(f), dest=f.name, **kwargs)


def as_argv(
    args: Any, *, exclude: tuple[str, ...] = (), overrides: dict[str, dict[str, Any]] | None = None
) -> list[str]:
    """The fields of the dataclass `args` that differ from their defaults, as argv.

    Values go as FLAG=VALUE, never FLAG VALUE: a value starting with "-" (a generated key, say)
    would be read as a flag of its own by the receiving parser."""
    argv: list[str] = []
    for f in fields(args):
        if f.name in exclude:
            continue
        spec = {**f.metadata["argparse"], **(overrides or {}).get(f.name, {})}
        default = spec.get("default", f.default)
        value = getattr(args, f.name)
        if value == default or (spec.get("action") == "append" and not value and not default):
            continue
        flag, action = flags_of(f)[0], spec.get("action")
        if action in ("store_true", "store_false"):
            argv.append(flag)  # differs from the default: the flag given
        elif action is argparse.BooleanOptionalAction:
            argv.append(flag if value else "--no-" + flag[2:])
        elif action == "append":
            argv += [f"{flag}={v}" for v in value]
        else:
            argv.append(f"{flag}={json.dumps(value) if isinstance(value, dict) else value}")
    return argv
