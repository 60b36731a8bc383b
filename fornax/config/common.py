"""What every config module shares: the default model, ConfigError and memory sizes."""

from __future__ import annotations

import re

DEFAULT_MODEL = "smollm2-135m-instruct"
GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


def parse_memory_size(value: int | float | str) -> int:
    """'2GiB', '512MiB', '1.5G', 1073741824 -> bytes. Plain numbers below 1024 mean GiB."""
    if isinstance(value, (int, float)):
        return int(value * GiB) if value < 1024 else int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", value.lower())
    if not m:
        raise ConfigError(f"cannot parse memory size {value!r} (try '2GiB' or '512MiB')")
    number, unit = float(m.group(1)), m.group(2)
    scale = {"": GiB if number < 1024 else 1, "k": 1 << 10, "m": 1 << 20, "g": GiB, "t": 1 << 40}[unit]
    return int(number * scale)
