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

Two more costs of the same parse, each removed without changing a value: the reader slices the
file through `np.memmap`, whose Python-level `__getitem__` and `__array_finalize__` run for every
one of the ~800k field parts (a plain ndarray view of the same mapping slices in C: the same
bytes); and transformers turns every part into a Python value with `_gguf_parse_value`, which
decodes a string byte by byte through a list of numpy scalars (`bytes()` of the part decodes the
same bytes at once); and the config and the tokenizer each parse the metadata (the second
call gets a copy of the first's result).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Iterator

import gguf
import numpy as np
import torch


def _same_values_faster(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    from fornax.layers.dequantize import dequantize

    return dequantize(data, qtype, torch.float32).numpy()


def _plain_mapping_numpy() -> types.ModuleType:
    """numpy's namespace, but `memmap` hands back a plain ndarray view of the mapping."""
    shim = types.ModuleType("numpy")
    shim.__dict__.update(np.__dict__)

    def memmap(*args: object, **kwargs: object) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)  # the view keeps the mapping open

    shim.memmap = memmap
    return shim


def _parse_value_at_once(value: np.ndarray, data_type: object) -> object:
    """transformers' `_gguf_parse_value`, with a string's bytes decoded in one call."""
    from transformers.integrations.ggml import _gguf_parse_value

    types_ = data_type if isinstance(data_type, list) else [data_type]
    if types_ in ([8], [9, 8]):  # a string, alone or as an array's element
        return bytes(value).decode()
    return _gguf_parse_value(value, data_type)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    import gguf.gguf_reader as reader_module
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    uncached, dequantize = gguf.GGUFReader, gguf.dequantize
    numpy, parse_value, load_checkpoint = (
        reader_module.np,
        hf_gguf._gguf_parse_value,
        hf_gguf.load_gguf_checkpoint,
    )
    metadata: dict[str, dict] = {}

    def metadata_once(path: object, return_tensors: bool = False, **kwargs: object) -> dict:
        """The config and tokenizer each parse the metadata: the second gets a copy of the first's."""
        if return_tensors or kwargs:
            return load_checkpoint(path, return_tensors, **kwargs)
        if str(path) not in metadata:
            metadata[str(path)] = load_checkpoint(path, False)
        return copy.deepcopy(metadata[str(path)])

    # transformers imports both from the package at each load
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(uncached)
    gguf.dequantize = _same_values_faster
    reader_module.np, hf_gguf._gguf_parse_value = _plain_mapping_numpy(), _parse_value_at_once
    hf_gguf.load_gguf_checkpoint = metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.dequantize = uncached, dequantize
        reader_module.np, hf_gguf._gguf_parse_value = numpy, parse_value
        hf_gguf.load_gguf_checkpoint = load_checkpoint


def greedy_disagreement(hf_model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> int | None:
    """The first position at which `tokens` is not transformers' greedy continuation of `prompt`
    (the token is not the model's argmax after everything before it), or None where it is.

    One forward over prompt + tokens instead of `generate()`'s one call per new token: greedy
    decoding is a function of the prefix alone, so `tokens` is the greedy output exactly when each
    token is the argmax after its prefix, and this sees every position even past an end-of-text
    token, where `generate()` would stop. Both compute the same logits with matmuls of other
    shapes; a genuine near-tie could fall either way in either, as on another machine."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])])
    with torch.inference_mode():
        argmax = hf_model(ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
    return next((i for i, (a, t) in enumerate(zip(argmax, tokens)) if a != t), None)


def logit_gap(model: torch.nn.Module, hf_model: torch.nn.Module, ids: list[int]) -> float:
    """The largest |our logit - transformers'| over one prompt run whole, in float32: ours
    through a fresh paged cache whose block table runs backwards (so it is really used), with the
    model's own sliding window, theirs as one plain forward."""
    from fornax.layers.attention import SeqSpan, build_attention_metadata
    from fornax.models.base import KVCache

    config, blocks = model.config, (len(ids) + 15) // 16
    cache = KVCache(config, blocks + 2, 16, torch.float32)
    table = list(range(blocks + 1, 1, -1))
    meta = build_attention_metadata(
        [SeqSpan(0, len(ids), table)],
        16,
        config.sliding_window,
        interleaved=config.interleaves_sliding_window,
    )
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
        ref = hf_model(torch.tensor([ids])).logits[0]
    return (ours - ref).abs().max().item()
