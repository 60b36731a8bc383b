"""EngineConfig refuses unknown weight forms and kernel backends with a clear error, and resolves
the small-step limit by the large-step form."""

from __future__ import annotations

import pytest

from fornax.config import (
    SMALL_STEP_MAX_ROWS,
    SMALL_STEP_MAX_ROWS_W8A8,
    CacheConfig,
    ConfigError,
    EngineConfig,
    OffloadConfig,
)


@pytest.mark.parametrize("value", ["int8", "int4", "auto", None])
def test_known_quantizations_are_accepted(value):
    assert EngineConfig(quantization=value).small_step_method == value


def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ConfigError, match="'int8', 'int4' or 'auto'"):
        EngineConfig(quantization="fp8")


def test_unknown_kernel_backend_is_a_clear_error():
    assert EngineConfig(kernel_backend="torch").kernel_backend == "torch"
    with pytest.raises(ConfigError, match="kernel_backend must be 'native' or 'torch'"):
        EngineConfig(kernel_backend="cuda")


def test_num_threads_must_be_positive():
    assert EngineConfig(num_threads=3).num_threads == 3
    with pytest.raises(ConfigError, match="num_threads must be >= 1"):
        EngineConfig(num_threads=0)


def test_large_step_quantization_and_the_small_step_limit_it_implies():
    assert EngineConfig().small_step_max_rows == SMALL_STEP_MAX_ROWS
    w8a8 = EngineConfig(large_step_quantization="w8a8")
    assert w8a8.small_step_max_rows == SMALL_STEP_MAX_ROWS_W8A8
    assert EngineConfig(large_step_quantization="w8a8", small_step_max_rows=5).small_step_max_rows == 5
    with pytest.raises(ConfigError, match="large_step_quantization must be one of"):
        EngineConfig(large_step_quantization="fp8")
    with pytest.raises(ConfigError, match="large_step_min_rows must be >= 1"):
        EngineConfig(large_step_min_rows=0)
    with pytest.raises(ConfigError, match="needs dtype 'bfloat16' and kernel_backend 'native'"):
        EngineConfig(large_step_quantization="w8a8", dtype="float32")
    with pytest.raises(ConfigError, match="needs dtype 'bfloat16' and kernel_backend 'native'"):
        EngineConfig(large_step_quantization="w8a8", kernel_backend="torch")


def test_kv_cache_dtype_is_checked_and_reaches_the_command_line():
    import torch

    from fornax.cli import build_parser
    from fornax.config import CacheConfig, ModelConfig
    from fornax.models.base import KVCache

    assert CacheConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8"):
        CacheConfig(kv_cache_dtype="fp8")
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    # int8 rows with a float32 scale per head row: (64 + 4) bytes against 2 * 64 for bf16,
    # so the same memory budget holds ~1.9x the blocks
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        intermediate_size=1536,
        vocab_size=49152,
        head_dim=64,
    )
    bf16 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    int8 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16, "int8")
    assert bf16 == 2 * 3 * 64 * 2 * 16 * 30 and int8 == 2 * 3 * (64 + 4) * 16 * 30


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dtype": "float16"}, "needs dtype 'bfloat16' or 'float32'"),
        ({"kernel_backend": "torch"}, "kernel_backend 'native'"),
        ({"lm_head_quantization": "int4"}, "one weight form per layer"),
        ({"offload": OffloadConfig(host_memory=2**30, dtype="int8")}, "give back the bits"),
    ],
)
def test_deterministic_mode_refuses_what_it_cannot_promise(settings, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(deterministic=True, **settings)
    EngineConfig(**settings)  # each is fine without it


def test_deterministic_mode_takes_int8_tiers_over_an_int8_cache():
    config = EngineConfig(
        deterministic=True,
        cache=CacheConfig(kv_cache_dtype="int8"),
        offload=OffloadConfig(host_memory=2**30, dtype="int8"),
    )
    assert config.deterministic and EngineConfig(dtype="float32", deterministic=True).deterministic
