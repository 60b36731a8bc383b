"""transformers loading a GGUF file: the independent reference the model and tokenizer tests
compare against.

transformers parses the whole file with `gguf.GGUFReader` for the config and again for the
tokenizer or the weights; each parse reads the vocabulary one field part at a time (~2 s for
the default model's 49k entries, ~8 s and ~0.7 GiB held for Gemma 3's 262k). Inside
`one_gguf_parse()` one parse serves every load, and it is dropped at the end. fornax itself
never uses GGUFReader (fornax/gguf_file.py says why), so this touches only the
reference side.

It then dequantizes every tensor with `gguf.dequantize`, numpy on one thread: ~40 s of the
Gemma 3 test's minute on 2 cores. Inside `one_gguf_parse()` that call gives the same values
from fornax's torch dequantizers, which equal the gguf package's bit for bit on every type they
carry (tests/model/test_gguf_loading.py checks that against gguf itself, on random blocks);
the name mapping, the layout changes and the config stay transformers' own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import gguf
import numpy as np
import torch


def _same_values_faster(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    from fornax.layers.dequantize import dequantize

    return dequantize(data, qtype, torch.float32).numpy()


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    uncached, dequantize = gguf.GGUFReader, gguf.dequantize
    # transformers imports both from the package at each load
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(uncached)
    gguf.dequantize = _same_values_faster
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.dequantize = uncached, dequantize
