"""Reading a GGUF's metadata defensively: every size it claims is bounded before anything is
sized from it, and every bad value is one clear line (ModelLoadError; docs/architecture.md)."""

from __future__ import annotations

import math
from typing import Any


class ModelLoadError(Exception):
    """A model file that cannot be used; the message is one clear line."""


# Bounds on the sizes a GGUF's metadata may claim, checked before anything is sized from them
# (the model's layers, the RoPE table, the list of expected tensors). Each is several times
# what the largest open models use today (about 130 layers, width 16k, FFN 53k, 128 heads
# of 128, vocabularies of 256k, contexts of 10M), so no real file is refused while a
# hostile one cannot ask for a huge allocation.
MAX_BLOCK_COUNT = 1024
MAX_EMBEDDING_LENGTH = 1 << 17
MAX_FEED_FORWARD_LENGTH = 1 << 20
MAX_HEAD_COUNT = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_CONTEXT_LENGTH = 1 << 24
MAX_VOCAB_SIZE = 1 << 22


def meta_int(metadata: dict[str, Any], key: str, upper: int, default: int | None = None) -> int:
    """An integer metadata value in [1, upper]: checked before anything is sized from it."""
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata is missing {key}")
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int, but never a size
        raise ModelLoadError(f"GGUF metadata {key} must be an integer, got {short_repr(value)}")
    if not 1 <= value <= upper:
        raise ModelLoadError(f"GGUF metadata {key} = {value} is out of range (1 to {upper})")
    return value


def meta_float(
    metadata: dict[str, Any], key: str, default: float | None = None, positive: bool = True
) -> float:
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata is missing {key}")
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number >= 0"
        raise ModelLoadError(f"GGUF metadata {key} must be {kind}, got {short_repr(value)}")
    return float(value)


def short_repr(value: Any) -> str:
    """A metadata value for an error line: a hostile file's value may be a 100k-item list."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
