"""Assembling an engine: load the model and its tokenizer, then build the core around them
(docs/architecture.md). Kept apart from engine/core.py, which is the step loop itself.
"""

from __future__ import annotations

import gc

import torch

from fornax.config import EngineConfig
from fornax.engine.core import EngineCore
from fornax.engine.executor import make_executor
from fornax.layers.process_memory import malloc_stats, release_free_heap
from fornax.tokenizer import Tokenizer


def build_engine_core(config: EngineConfig, progress: bool = True) -> EngineCore:
    """Resolve and load the model and its tokenizer, then size the cache and build the core."""
    from fornax.models import load_engine_model

    # Set before loading: torch sizes its pool on first use, and the native kernels ask it.
    torch.set_num_threads(config.threads_per_process())
    executor = make_executor(config)  # worker ranks, if any, load their slices meanwhile
    loaded = load_engine_model(config, progress, shard=executor.shard)
    heap_before = malloc_stats()
    if loaded.resolved.gguf_path is not None:
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata)
        # The vocabulary and merges as Python strings (~8 MiB): the tokenizer has its own copy.
        for key in [k for k in loaded.metadata if k.startswith("tokenizer.ggml.")]:
            del loaded.metadata[key]
    else:
        assert loaded.resolved.hf_dir is not None
        tokenizer = Tokenizer.from_pretrained_dir(loaded.resolved.hf_dir)
    heap_after = malloc_stats()
    core = EngineCore(config, loaded, tokenizer, executor)
    if heap_before is not None and heap_after is not None:  # the memory breakdown's tokenizer line
        core.tokenizer_bytes = max(0, heap_after.in_use - heap_before.in_use)
    # What loading left (modules, weights' wrappers, the vocabulary) lives as long as the engine;
    # freezing it keeps the cyclic collector from re-scanning it on its full passes, which
    # took ~5% of a single-stream decode step (perf, 2026-12-03).
    gc.collect()
    gc.freeze()
    release_free_heap()
    return core
