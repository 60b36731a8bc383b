"""How many K/V blocks an engine allocates (docs/architecture.md, "The parts").

The pools hold whole 16-token blocks; their number follows from the KV budget (given, or
config.default_kv_cache_memory's share of the machine) and the bytes a block takes for this
model, dtype and K/V format. An encoder keeps no K/V: it gets one sequence's worth of block
ids per running slot, which its prefill-only requests book and never fill.
"""

from __future__ import annotations

import logging

import torch

from fornax.config import EngineConfig, default_kv_cache_memory
from fornax.models import LoadedModel

logger = logging.getLogger("fornax.engine")


def kv_cache_blocks(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, max_len: int) -> int:
    """The number of K/V blocks for `config` (its own num_blocks when set); logs the size."""
    cache = config.cache
    block_bytes = loaded.kv_cache_bytes_per_block(cache.block_size, dtype, cache.kv_cache_dtype)
    budget = cache.kv_cache_memory
    if budget is None:  # "auto"
        per_token = block_bytes // cache.block_size
        budget = default_kv_cache_memory(per_token, max_len, config.scheduler.max_num_seqs)
    seq_blocks = config.scheduler.max_num_seqs * -(-max_len // cache.block_size)  # an encoder: no K/V
    num_blocks = cache.num_blocks or (max(1, budget // block_bytes) if block_bytes else seq_blocks)
    auto = " (auto)" if cache.kv_cache_memory is None else ""
    mib = num_blocks * block_bytes / 2**20
    logger.info("KV cache: %d blocks of %d tokens, %.0f MiB%s", num_blocks, cache.block_size, mib, auto)
    return num_blocks
