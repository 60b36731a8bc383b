"""EngineArgs: every engine setting a user can give, each once, with its default and its help.

The engine flags of every command that runs an engine (`fornax generate | chat | memory |
serve`, and `fornax cluster up`, which hands serve's flags on to its replicas) and the keyword
arguments of `LLM(...)` are both built from this one dataclass, so they are the same set by
construction. The defaults are read from the frozen configs (fornax/config/, the only home
of defaults); `create_engine_config()` turns the arguments into the EngineConfig an engine is
built from.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from fornax.config import (
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    KV_CACHE_MEMORY_FRACTION,
    KV_OFFLOAD_DTYPES,
    LARGE_STEP_METHODS,
    LM_HEAD_METHODS,
    POOLING_TYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    SMALL_STEP_MAX_ROWS,
    SMALL_STEP_MAX_ROWS_W8A8,
    SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT,
    CacheConfig,
    ConfigError,
    EngineConfig,
    GiB,
    LoRAConfig,
    OffloadConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_adapter_flag,
    parse_kv_cache_memory,
    parse_memory_size,
)
from fornax.flag_fields import add_fields, as_argv, flag_field

# The argument groups of the help, in order. "model" flags go on the command's own options.
MODEL, ENGINE, TIERS, SPECULATIVE = "model", "engine", "KV cache tiers", "speculative decoding"
LORA = "LoRA adapters"
GROUPS = (MODEL, ENGINE, TIERS, SPECULATIVE, LORA)

# Where a command's flags differ from the offline engine's (LLM): `fornax serve` takes several
# models, and a smaller token budget per step (SERVE_MAX_NUM_BATCHED_TOKENS says why).
COMMAND_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "serve": {
        "model": {
            "action": "append",
            "default": None,
            "help": "GGUF file, HF directory or alias; repeat to serve several models",
        },
        "max_num_batched_tokens": {"default": SERVE_MAX_NUM_BATCHED_TOKENS},
    },
}


def _declared(config: type, name: str) -> Any:
    """A frozen config's default for `name` as the class declares it (EngineConfig resolves
    some in __post_init__, e.g. small_step_max_rows: None means "by the large-step form")."""
    return config.__dataclass_fields__[name].default


def _arg(default: Any, help: str, *, group: str = MODEL, **kwargs: Any) -> Any:
    return flag_field(default, help, group=group, **kwargs)


def _named(values: tuple[str | None, ...]) -> list[str]:
    """A config's accepted values as flag choices: None is the flag left out."""
    return [v for v in values if v is not None]


def _gib(n: int) -> str:
    return f"{n / GiB:g}GiB"


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting a user can give; the field names are LLM's keyword arguments and,
    spelled with dashes, the flags (the exceptions name their flag in `flags`)."""

    model: str = _arg(
        _declared(EngineConfig, "model"), "GGUF file, HF directory or alias", flags=("--model", "-m")
    )
    dtype: str = _arg(
        "auto",
        "weights' and activations' dtype (auto: bfloat16 where the native kernels or the CPU compute it, "
        "else float32: layers/kernel_plan.py resolve_dtype)",
        choices=["auto", *DTYPES],
    )
    quantization: str | None = _arg(
        _declared(EngineConfig, "quantization"),
        "weight-only quantized kernels for small (decode) steps (auto: the GGUF's own); default: dense",
        choices=_named(QUANTIZATION_METHODS),
    )
    small_step_max_rows: int | None = _arg(
        _declared(EngineConfig, "small_step_max_rows"),
        "steps of at most this many tokens use the quantized kernels "
        f"(default {SMALL_STEP_MAX_ROWS}; with w8a8 large steps {SMALL_STEP_MAX_ROWS_W8A8}, "
        f"or {SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT} where the CPU's int8 kernel has no byte dot product: "
        "AVX2, AVX-512 without VNNI)",
        type=int,
    )
    large_step_quantization: str | None = _arg(
        _declared(EngineConfig, "large_step_quantization"),
        "w8a8: int8 weights and activations for large steps (prefill, big batches); default: bf16",
        choices=_named(LARGE_STEP_METHODS),
    )
    large_step_min_rows: int = _arg(
        _declared(EngineConfig, "large_step_min_rows"),
        "steps of at least this many tokens (past the small-step limit) use the large-step form",
        type=int,
    )
    lm_head_quantization: str | None = _arg(
        _declared(EngineConfig, "lm_head_quantization"),
        "int4: an int4 LM head for one- and two-row steps (large vocabularies); default: as the other weights",
        choices=_named(LM_HEAD_METHODS),
    )
    kernel_backend: str = _arg(
        _declared(EngineConfig, "kernel_backend"),
        "native: compiled paged attention and fused layer ops (torch ops if they cannot be built)",
        choices=list(KERNEL_BACKENDS),
    )
    num_threads: int | None = _arg(
        _declared(EngineConfig, "num_threads"),
        "engine compute threads (default: every CPU this process may use)",
        type=int,
    )
    tensor_parallel_size: int = _arg(
        _declared(EngineConfig, "tensor_parallel_size"),
        "split every layer over this many processes (gloo; docs/tensor-parallel.md)",
        group=ENGINE,
        type=int,
    )
    distributed_init: str | None = _arg(
        _declared(EngineConfig, "distributed_init"),
        "tcp://host:port of a tensor-parallel group whose other ranks `fornax worker` starts",
        group=ENGINE,
    )
    distributed_timeout: float = _arg(
        _declared(EngineConfig, "distributed_timeout"),
        "seconds any tensor-parallel collective may take before the engine fails",
        group=ENGINE,
        type=float,
    )
    deterministic: bool = _arg(
        _declared(EngineConfig, "deterministic"),
        "batch-invariant numerics: a request's tokens and logprobs depend only on its own tokens "
        "(not on what shares its steps, the prefix cache, chunking or speculation); costs speed",
        group=ENGINE,
        action="store_true",
    )
    # "auto" (or None): sized for the model and the machine (config.default_kv_cache_memory).
    kv_cache_memory: int | float | str | None = _arg(
        _declared(CacheConfig, "kv_cache_memory"),
        f"KV cache budget, e.g. 512MiB; auto: {KV_CACHE_MEMORY_FRACTION * 100:g}%% of the machine's memory, "
        "at least one max-model-len sequence, at most max-num-seqs of them (docs/memory.md)",
    )
    kv_cache_dtype: str = _arg(
        _declared(CacheConfig, "kv_cache_dtype"),
        "auto: the model's dtype; int8: int8 K/V with a scale per token and head "
        "(half the bytes; faster long-context decode)",
        choices=list(KV_CACHE_DTYPES),
    )

    max_num_seqs: int = _arg(
        _declared(SchedulerConfig, "max_num_seqs"),
        "sequences in one engine step, at most",
        group=ENGINE,
        type=int,
    )
    max_num_batched_tokens: int = _arg(
        _declared(SchedulerConfig, "max_num_batched_tokens"),
        "tokens computed per engine step, at most",
        group=ENGINE,
        type=int,
    )
    max_model_len: int = _arg(
        _declared(SchedulerConfig, "max_model_len"),
        "longest sequence, prompt and output (capped by the model's context)",
        group=ENGINE,
        type=int,
    )
    scheduling_policy: str = _arg(
        _declared(SchedulerConfig, "policy"),
        "fcfs: in order of arrival; priority: a request's lower `priority` value first",
        group=ENGINE,
        choices=list(SCHEDULING_POLICIES),
    )
    long_prefill_token_threshold: int = _arg(
        _declared(SchedulerConfig, "long_prefill_token_threshold"),
        "a prefill chunk takes at most this many tokens of a step, so decodes keep flowing (0: the whole budget)",
        group=ENGINE,
        type=int,
    )
    block_size: int = _arg(
        _declared(CacheConfig, "block_size"),
        "tokens per KV cache block (a power of two up to 256)",
        group=ENGINE,
        type=int,
    )
    num_blocks: int | None = _arg(
        _declared(CacheConfig, "num_blocks"),
        "KV cache blocks (default: as --kv-cache-memory sizes them)",
        group=ENGINE,
        type=int,
    )
    enable_prefix_caching: bool = _arg(
        _declared(CacheConfig, "enable_prefix_caching"),
        "do not reuse the KV blocks of earlier prompts' prefixes",
        group=ENGINE,
        flags=("--no-prefix-caching",),
        action="store_false",
    )
    seed: int = _arg(
        _declared(EngineConfig, "seed"),
        "seed of the engine's random generator (requests without a seed of their own)",
        group=ENGINE,
        type=int,
    )
    pooling: str | None = _arg(
        _declared(EngineConfig, "pooling"),
        "how embedding requests pool the final hidden states by default (a request may ask otherwise); "
        "default: the model's own pooling config, else mean for encoders and last for decoders",
        group=ENGINE,
        choices=list(POOLING_TYPES),
    )

    kv_offload_memory: int | float | str = _arg(
        _declared(OffloadConfig, "host_memory"),
        "host-memory tier (e.g. 4GiB): evicted prefix blocks are kept there and loaded back on a hit "
        "instead of recomputed; preempted requests swap to it",
        group=TIERS,
    )
    kv_offload_dir: str | None = _arg(
        _declared(OffloadConfig, "disk_dir"),
        "disk tier directory: blocks persist across restarts (needs --kv-offload-memory)",
        group=TIERS,
    )
    kv_offload_disk: int | float | str = _arg(
        _declared(OffloadConfig, "disk_bytes"),
        f"the disk tier's size bound (LRU; default {_gib(_declared(OffloadConfig, 'disk_bytes'))})",
        group=TIERS,
    )
    kv_offload_dtype: str = _arg(
        _declared(OffloadConfig, "dtype"),
        "form of offloaded blocks: auto (the KV cache's own, exact) or int8 (half of bf16)",
        group=TIERS,
        choices=list(KV_OFFLOAD_DTYPES),
    )
    preemption_mode: str | None = _arg(
        _declared(OffloadConfig, "preemption_mode"),
        "what preemption does with a request's KV: swap it to the host tier (the default with one) or recompute it",
        group=TIERS,
        choices=list(PREEMPTION_MODES),
    )

    # A dict, its JSON text (as on the command line) or a SpeculativeConfig.
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = _arg(  # noqa: RUF009 - a field()
        None,
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: ngram, draft '
        '(with "model"), self (with "draft_layers" and/or "quantization")',
        group=SPECULATIVE,
        metavar="JSON",
    )
    speculative_model: str | None = _arg(
        None, "draft model (same tokenizer): shorthand for method 'draft' with this model", group=SPECULATIVE
    )
    num_speculative_tokens: int | None = _arg(
        None,
        "draft tokens per step (overrides the value in --speculative-config)",
        group=SPECULATIVE,
        type=int,
    )

    # Repeated: None when not given, as ServerArgs' repeated flags (argparse cannot append to a tuple).
    lora: tuple[str, ...] | list[str] | None = _arg(  # noqa: RUF009 - a field()
        None,
        "a LoRA adapter as NAME=PATH (a PEFT directory; repeatable): requests pick it with model=NAME",
        group=LORA,
        action="append",
        metavar="NAME=PATH",
    )
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters (implied by --lora): slots for them, and adapters loadable at run time",
        group=LORA,
        action="store_true",
    )
    max_loras: int = _arg(
        _declared(LoRAConfig, "max_loras"),
        "adapters resident at once (one step mixes any of them); others wait for a free slot",
        group=LORA,
        type=int,
    )
    max_lora_rank: int = _arg(
        _declared(LoRAConfig, "max_lora_rank"),
        "the largest adapter rank accepted (the slots are sized for it)",
        group=LORA,
        type=int,
    )

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        command: str,
        *,
        exclude: tuple[str, ...] = (),
        groups: tuple[str, ...] = GROUPS,
    ) -> None:
        """Add the engine flags of `command` (its COMMAND_OVERRIDES applied) to `parser`:
        those of `groups`, less the fields in `exclude` (a flag the command spells for
        something else)."""
        add_fields(
            cls,
            parser,
            own_group=MODEL,
            groups=groups,
            exclude=exclude,
            overrides=COMMAND_OVERRIDES.get(command),
        )

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The fields a command's flags gave (the others at their defaults), then `overrides`
        (e.g. the one model of several `fornax serve` was given)."""
        given = {name: getattr(namespace, name) for name in cls.names() if hasattr(namespace, name)}
        return cls(**(given | overrides))

    def as_argv(self, command: str, exclude: tuple[str, ...] = ()) -> list[str]:
        """The settings that differ from `command`'s defaults, as its flags would give them."""
        return as_argv(self, exclude=exclude, overrides=COMMAND_OVERRIDES.get(command))

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as LLM's keyword arguments (a shallow copy: values are not converted)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def resolved_dtype(self) -> str:
        """`dtype`, with "auto" decided for this CPU and kernel backend (it may build the kernels)."""
        if self.dtype != "auto":
            return self.dtype
        from fornax.layers.kernel_plan import resolve_dtype  # loads torch: only when an engine is made

        return resolve_dtype(self.kernel_backend)

    def resolved_small_step_max_rows(self) -> int | None:
        """`small_step_max_rows`; unset beside w8a8 large steps, decided for this CPU's kernels
        (layers/kernel_plan.py w8a8_small_step_rows); else left to EngineConfig's default."""
        if self.small_step_max_rows is not None or self.large_step_quantization != "w8a8":
            return self.small_step_max_rows
        if self.kernel_backend != "native":
            return None
        from fornax.layers.kernel_plan import w8a8_small_step_rows  # loads torch, as resolved_dtype
        from fornax.layers.native import library_level

        level = library_level()
        return w8a8_small_step_rows(level.name if level is not None else None)

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=str(self.model),
            dtype=self.resolved_dtype(),
            quantization=self.quantization,
            small_step_max_rows=self.resolved_small_step_max_rows(),
            large_step_quantization=self.large_step_quantization,
            large_step_min_rows=self.large_step_min_rows,
            lm_head_quantization=self.lm_head_quantization,
            kernel_backend=self.kernel_backend,
            num_threads=self.num_threads,
            deterministic=self.deterministic,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_init=self.distributed_init,
            distributed_timeout=self.distributed_timeout,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=parse_kv_cache_memory(self.kv_cache_memory),
                num_blocks=self.num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            speculative=self.create_speculative_config(),
            offload=OffloadConfig(
                host_memory=parse_memory_size(self.kv_offload_memory) if self.kv_offload_memory else 0,
                disk_dir=None if self.kv_offload_dir is None else str(self.kv_offload_dir),
                disk_bytes=parse_memory_size(self.kv_offload_disk),
                dtype=self.kv_offload_dtype,
                preemption_mode=self.preemption_mode,
            ),
            seed=self.seed,
            pooling=self.pooling,
            lora=self.create_lora_config(),
        )

    def create_lora_config(self) -> LoRAConfig | None:
        """The adapters' config: present with --enable-lora or any --lora."""
        if not self.enable_lora and not self.lora:
            return None
        adapters = tuple(parse_adapter_flag(value) for value in self.lora or ())
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, adapters=adapters)

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """speculative_config, with the speculative_model / num_speculative_tokens shorthands
        merged in."""
        base = SpeculativeConfig.from_dict(self.speculative_config)
        value: dict[str, Any] = {} if base is None else {f.name: getattr(base, f.name) for f in fields(base)}
        if self.speculative_model:
            value |= {"method": value.get("method", "draft"), "model": self.speculative_model}
        if self.num_speculative_tokens is not None:
            if not value:
                raise ConfigError(
                    "--num-speculative-tokens needs --speculative-config or --speculative-model"
                )
            value["num_speculative_tokens"] = self.num_speculative_tokens
        return SpeculativeConfig.from_dict(value) if value else None
