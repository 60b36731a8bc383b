"""Build the tier stack an EngineConfig asks for: sizes in blocks, the model's identity on disk."""

from __future__ import annotations

import logging
from pathlib import Path

from fornax.config import EngineConfig, ModelConfig, fornax_home
from fornax.engine.kv.offload.disk_store import DiskStore, file_digest, model_identity
from fornax.engine.kv.offload.host_pool import BlockLayout
from fornax.engine.kv.offload.tiered import TieredConnector
from fornax.models import DTYPES, LoadedModel

logger = logging.getLogger("fornax.kv.offload")

# Bump when the bytes of a stored block change meaning (layout, quantization of the int8 form).
KV_FORMAT_VERSION = 1


def weights_files(loaded: LoadedModel) -> list[Path]:
    """The files whose bytes make the model: its GGUF, or an HF directory's config and weights."""
    resolved = loaded.resolved
    if resolved.gguf_path is not None:
        return [Path(resolved.gguf_path)]
    assert resolved.hf_dir is not None
    root = Path(resolved.hf_dir)
    return sorted(root.glob("*.safetensors")) + [p for p in (root / "config.json",) if p.exists()]


def host_block_layout(config: EngineConfig, model: ModelConfig) -> BlockLayout:
    """How the host tier stores one block of `model`'s KV (a tensor-parallel rank's: its heads)."""
    # The tier stores int8 rows when asked to, and always when the primary pool already does.
    quantized = config.offload.dtype == "int8" or config.cache.kv_cache_dtype == "int8"
    return BlockLayout(
        model.num_hidden_layers,
        config.cache.block_size,
        model.num_key_value_heads,
        model.head_dim,
        DTYPES[config.dtype],
        quantized,
    )


def build_connector(config: EngineConfig, loaded: LoadedModel) -> TieredConnector:
    # a tensor-parallel rank's tier holds its own KV heads' part of each block
    offload, cache, mc = config.offload, config.cache, loaded.local_config or loaded.config
    layout = host_block_layout(config, mc)
    quantized = layout.quantized
    host_blocks = offload.host_memory // layout.block_bytes
    if host_blocks < 1:
        raise ValueError(
            f"--kv-offload-memory {offload.host_memory} bytes holds no block "
            f"({layout.block_bytes} bytes each)"
        )
    disk = None
    if offload.disk_dir is not None:
        root = Path(offload.disk_dir).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        digest = file_digest(weights_files(loaded), cache_file=fornax_home() / "kv-identity-memo.json")
        identity = model_identity(
            digest,
            version=KV_FORMAT_VERSION,
            dtype=config.dtype,
            kv_cache_dtype=cache.kv_cache_dtype,
            tier_form="int8" if quantized else "auto",
            block_size=cache.block_size,
            layers=mc.num_hidden_layers,
            kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
        )
        disk = DiskStore(root, identity, offload.disk_bytes, layout.block_bytes)
        logger.info("KV disk tier: %s, %d block(s) found", disk.dir, disk.num_files)
    logger.info(
        "KV host tier: %d block(s) of %d bytes (%s)",
        host_blocks,
        layout.block_bytes,
        "int8" if quantized else config.dtype,
    )
    return TieredConnector(layout, host_blocks, disk, cache.enable_prefix_caching)
