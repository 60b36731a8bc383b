"""Frozen configs: the only home of defaults, validation and environment variables.

What is learned later (for example the number of KV blocks after sizing the pool) comes
back as a new object via `dataclasses.replace`, never by mutation (DESIGN.md rule 5).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


def fornax_home() -> Path:
    """Cache root for fetched models (FORNAX_HOME, default ~/.cache/fornax)."""
    return Path(os.environ.get("FORNAX_HOME") or Path.home() / ".cache" / "fornax").expanduser()


def env_api_key() -> str | None:
    return os.environ.get("FORNAX_API_KEY") or None


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


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face's vocabulary."""

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    hidden_act: str = "silu"
    sliding_window: int | None = None
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"unsupported activation {self.hidden_act!r} (only SwiGLU/silu models)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks in one preallocated pool per layer."""

    block_size: int = 16
    kv_cache_memory: int = 1 * GiB  # bytes; ignored when num_blocks is given
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two up to 256, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192  # capped by the model's context length at engine build time
    policy: str = "fcfs"  # "fcfs" or "priority"
    # A prefill chunk never takes more than this many tokens of one step, so decodes keep
    # flowing when a long prompt arrives (0: up to the whole budget).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, built once."""

    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    # Weight form for steps of at most `small_step_max_rows` tokens (decode-heavy steps):
    # None keeps the dense weights everywhere (exact); "int8"/"int4" use weight-only
    # quantized kernels there. Larger steps always use the dense weights (bf16 wins there).
    quantization: str | None = None
    # int4 beats bf16 per decode step up to ~24-32 rows here (benchmarks/decode_step.py)
    small_step_max_rows: int = 24
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"dtype must be 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.small_step_max_rows < 0:
            raise ConfigError("small_step_max_rows must be >= 0")

    @property
    def small_step_method(self) -> str | None:
        """Kernel for small steps, or None when the dense weights serve every step."""
        return self.quantization


def env_api_key_file() -> str | None:
    return os.environ.get("FORNAX_API_KEY_FILE") or None


def load_api_keys(keys: list[str] | tuple[str, ...] = (), key_file: str | None = None) -> tuple[tuple[str, str], ...]:
    """(name, key) pairs from `--api-key` values, FORNAX_API_KEY and a key file.

    A key file holds one key per line, optionally `name:key`; blank lines and `#` comments are
    skipped. Keys given without a name are called `key-<n>` (n counts from 1 in order given), so
    per-key usage never shows a secret.
    """
    raw: list[str] = list(keys)
    if env_api_key():
        raw.append(env_api_key() or "")
    path = key_file or env_api_key_file()
    if path:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from exc
        raw += [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    pairs: list[tuple[str, str]] = []
    for n, entry in enumerate(raw, start=1):
        name, sep, key = entry.partition(":")
        name, key = (name.strip(), key.strip()) if sep and name.strip() and key.strip() else (f"key-{n}", entry)
        if not key:
            raise ConfigError("an API key must not be empty")
        pairs.append((name, key))
    return tuple(pairs)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server: where it listens, who may call it and how much one request may ask for."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)  # the first is the name in responses
    api_keys: tuple[tuple[str, str], ...] = ()  # (name, key); empty: the server is open
    public_metrics: bool = False
    access_log: bool = True
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long to finish on SIGTERM
    # Per-request bounds: each is a flag of `fornax serve`.
    max_queued_requests: int = 256  # waiting requests beyond this get 429
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_tokens_limit: int | None = None  # None: up to the context; larger requests are clamped
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logit_bias: int = 300
    max_top_logprobs: int = 20
    max_messages: int = 1024
    max_prompts: int = 64  # prompts in one /v1/completions batch
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not self.served_model_names:
            raise ConfigError("at least one served model name is needed")
        for name in ("max_queued_requests", "max_stop_strings", "max_logit_bias"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in ("max_body_bytes", "max_n", "max_stop_string_chars", "max_messages", "max_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ConfigError("max_tokens_limit must be at least 1")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ConfigError("max_top_logprobs must be in [0, 20] (the engine's bound)")
        if self.shutdown_timeout_s < 0:
            raise ConfigError("shutdown_timeout_s must be >= 0")
