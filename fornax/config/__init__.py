"""Frozen configs: the only home of defaults and validation, split by owner (docs/architecture.md):
common (the default model, ConfigError, memory sizes), environment (every environment variable
and the machine), model (a model's architecture; moe: its experts), engine (EngineConfig and
its parts), pooling (how a model embeds), lora (the adapters over it), keys (API keys, rate
limits) and server (ServerConfig). What is learned later (for example the number of KV blocks
after sizing the pool) comes back as a new object via `dataclasses.replace`, never by
mutation (rule 5).

Every public name is importable from `fornax.config` itself.
"""

from __future__ import annotations

from fornax.config.common import DEFAULT_MODEL, ConfigError, GiB, parse_memory_size
from fornax.config.engine import (
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    KV_CACHE_MEMORY_FRACTION,
    KV_OFFLOAD_DTYPES,
    LARGE_STEP_METHODS,
    LM_HEAD_METHODS,
    PREEMPTION_MODES,
    PRIORITY_RANGE,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    SMALL_STEP_MAX_ROWS,
    SMALL_STEP_MAX_ROWS_W8A8,
    SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    OffloadConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_kv_cache_memory,
    parse_kv_cache_memory,
)
from fornax.config.environment import (
    debug_checks_enabled,
    env_admin_key,
    env_admin_key_file,
    env_api_key,
    env_api_key_file,
    env_c_compiler,
    env_fornax_home,
    env_isa,
    fornax_home,
    machine_memory,
)
from fornax.config.keys import (
    PREFIX_CACHE_SCOPES,
    RATE_LIMIT_FIELDS,
    RateLimit,
    load_admin_keys,
    load_api_keys,
    load_key_limits,
)
from fornax.config.lora import LoRAConfig, check_adapter_name, parse_adapter_flag
from fornax.config.model import ACTIVATIONS, ModelConfig
from fornax.config.moe import MAX_EXPERTS, MOE_NAMINGS, MoEConfig
from fornax.config.pooling import POOLING_TYPES, PoolingConfig
from fornax.config.server import ServedModelConfig, ServerConfig

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_MODEL",
    "DTYPES",
    "KERNEL_BACKENDS",
    "KV_CACHE_DTYPES",
    "KV_CACHE_MEMORY_FRACTION",
    "KV_OFFLOAD_DTYPES",
    "LARGE_STEP_METHODS",
    "LM_HEAD_METHODS",
    "MAX_EXPERTS",
    "MOE_NAMINGS",
    "POOLING_TYPES",
    "PREEMPTION_MODES",
    "PREFIX_CACHE_SCOPES",
    "PRIORITY_RANGE",
    "QUANTIZATION_METHODS",
    "RATE_LIMIT_FIELDS",
    "SCHEDULING_POLICIES",
    "SERVE_MAX_NUM_BATCHED_TOKENS",
    "SMALL_STEP_MAX_ROWS",
    "SMALL_STEP_MAX_ROWS_W8A8",
    "SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT",
    "SPEC_METHODS",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "GiB",
    "LoRAConfig",
    "MoEConfig",
    "ModelConfig",
    "OffloadConfig",
    "PoolingConfig",
    "RateLimit",
    "SchedulerConfig",
    "ServedModelConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "check_adapter_name",
    "debug_checks_enabled",
    "default_kv_cache_memory",
    "env_admin_key",
    "env_admin_key_file",
    "env_api_key",
    "env_api_key_file",
    "env_c_compiler",
    "env_fornax_home",
    "env_isa",
    "fornax_home",
    "load_admin_keys",
    "load_api_keys",
    "load_key_limits",
    "machine_memory",
    "parse_adapter_flag",
    "parse_kv_cache_memory",
    "parse_memory_size",
]
