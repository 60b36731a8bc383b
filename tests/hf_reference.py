"""transformers loading a GGUF file: the independent reference the model and tokenizer tests
compare against.

transformers parses the whole file with `gguf.GGUFReader` for the config and again for the
tokenizer or the weights; each parse reads the vocabulary one field part at a time (~2 s for
the default model's 49k entries, ~8 s and ~0.7 GiB held for Gemma 3's 262k). Inside
`one_gguf_parse()` one parse serves every load, and it is dropped at the end. fornax itself
never uses GGUFReader (fornax/gguf_file.py says why), so this touches only the
reference side.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import gguf


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    uncached = gguf.GGUFReader
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(uncached)  # transformers imports it per load
    try:
        yield
    finally:
        gguf.GGUFReader = uncached
