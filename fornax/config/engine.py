"""The engine's frozen configs: the model's shape, the KV cache and its tiers, the scheduler,
speculative decoding and the EngineConfig that holds them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from fornax.config.common import DEFAULT_MODEL, ConfigError, GiB, parse_memory_size
from fornax.config.environment import (
    machine_memory,
)
from fornax.config.lora import LoRAConfig
from fornax.config.pooling import POOLING_TYPES


def parse_kv_cache_memory(value: int | float | str | None) -> int | None:
    """parse_memory_size, or None for "auto" (default_kv_cache_memory decides)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_memory_size(value)


# The automatic KV budget's share of the machine's memory (or of the container's limit):
# about what the fixed 1 GiB default was on the 24 GiB machines the figures come from.
KV_CACHE_MEMORY_FRACTION = 0.05


def default_kv_cache_memory(
    bytes_per_token: int, max_model_len: int, max_num_seqs: int, total: int | None = None
) -> int:
    """The KV budget when none is given, like vLLM's share of device memory and llama.cpp's
    context from the model: KV_CACHE_MEMORY_FRACTION of the machine's memory, but at least one
    sequence of max_model_len tokens (else the longest requests could never run) and at most
    what max_num_seqs sequences of that length can fill (more would never be used). The
    pools are not touched until used, so a large budget costs memory only as it fills."""
    one_sequence = bytes_per_token * max_model_len
    share = int(KV_CACHE_MEMORY_FRACTION * (machine_memory() if total is None else total))
    return min(max(share, one_sequence), one_sequence * max_num_seqs)


KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype (fornax/layers/kv_pool.py)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks in one preallocated pool per layer."""

    block_size: int = 16
    # bytes; None ("auto"): sized for the model and the machine (default_kv_cache_memory).
    # Ignored when num_blocks is given.
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "int8": int8 rows with a scale per token and KV head
    # (layers/kv_pool.py), half the bytes for long-context attention to read.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two up to 256, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be positive")


KV_OFFLOAD_DTYPES = ("auto", "int8")  # auto: the primary pool's own form
PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class OffloadConfig:
    """KV cache tiers below the primary pool (engine/kv/offload): host memory, then disk.

    Tier 1 (`host_memory` bytes) keeps blocks evicted from the primary pool, and the blocks of
    preempted requests when preemption swaps; tier 2 (`disk_dir`, at most `disk_bytes`) keeps
    every block tier 1 receives, across restarts. A tier-2 directory needs tier 1: blocks reach
    the disk through it.
    """

    host_memory: int = 0  # bytes; 0: no tiers at all
    disk_dir: str | None = None
    disk_bytes: int = 20 * GiB
    # "auto": the primary pool's form, so a block comes back bit for bit; "int8": int8 rows with
    # a float32 scale per token and KV head (layers/kv_pool.py), half of bf16's bytes per block.
    dtype: str = "auto"
    # None: "swap" when tier 1 exists, else "recompute".
    preemption_mode: str | None = None

    def __post_init__(self) -> None:
        if self.host_memory < 0 or self.disk_bytes <= 0:
            raise ConfigError("kv offload sizes must be positive (host memory 0 turns the tiers off)")
        if self.dtype not in KV_OFFLOAD_DTYPES:
            raise ConfigError(
                f"kv offload dtype must be one of {', '.join(KV_OFFLOAD_DTYPES)}, got {self.dtype!r}"
            )
        if self.disk_dir is not None and not self.host_memory:
            raise ConfigError(
                "--kv-offload-dir needs --kv-offload-memory: blocks reach the disk tier through host memory"
            )
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ConfigError(
                f"preemption mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not self.host_memory:
            raise ConfigError("preemption mode 'swap' needs a host tier (--kv-offload-memory)")

    @property
    def enabled(self) -> bool:
        return self.host_memory > 0

    @property
    def swap(self) -> bool:
        return self.enabled and self.preemption_mode != "recompute"


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # offline (LLM); `fornax serve`: SERVE_MAX_NUM_BATCHED_TOKENS
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
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


# Steps of at most this many rows use the small-step weight form (quantized, or the native
# bf16 kernel in dense models): up to where it stops beating the dense kernel that takes the
# larger steps (docs/performance.md).
SMALL_STEP_MAX_ROWS = 12
# ... and where the large steps run int8 x int8 (large_step_quantization "w8a8"), int4 beats
# that kernel at one row only (docs/performance.md).
SMALL_STEP_MAX_ROWS_W8A8 = 1
# ... unless that kernel has no byte dot product into int32 (AVX2, AVX-512 without VNNI): there
# int4 stays ahead up to 4 rows (layers/kernel_plan.py w8a8_small_step_rows says where).
SMALL_STEP_MAX_ROWS_W8A8_NO_BYTE_DOT = 4

# `fornax serve`'s token budget per step (fornax/engine_args.py applies it to the serve
# flags): smaller than the offline one, because on a CPU a step's time grows with its tokens
# and every running stream waits for it; long prompts then prefill in more chunks
# (docs/performance.md).
SERVE_MAX_NUM_BATCHED_TOKENS = 512

# The range of a request's `priority` (lower runs earlier; vLLM's convention). Bounded so a
# priority means the same thing from every client; negative ones are for privileged keys.
PRIORITY_RANGE = (-1000, 1000)

SPEC_METHODS = ("ngram", "draft", "self")
DTYPES = ("bfloat16", "float32", "float16")
QUANTIZATION_METHODS = (None, "int8", "int4", "auto")
LARGE_STEP_METHODS = (None, "w8a8")
LM_HEAD_METHODS = (None, "int4")
KERNEL_BACKENDS = ("native", "torch")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, configured the vLLM way: one dict with a `method` and its knobs.

    Every method proposes up to `num_speculative_tokens` tokens per request and step; the
    target verifies them in the same forward pass as the rest of the batch (lossless).
    """

    method: str  # "ngram" (prompt lookup) | "draft" (a smaller model) | "self" (the target, cut down)
    num_speculative_tokens: int = 4
    # ngram: match the longest suffix of prompt + output of length in [min, max] seen earlier.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft: a model with the target's tokenizer (path, GGUF file, HF directory or alias).
    model: str | None = None
    # self: the target's first `draft_layers` layers + final norm + LM head (None: all layers),
    # optionally with weight-only quantized linears (`quantization`: "int8" | "int4").
    draft_layers: int | None = None
    quantization: str | None = None
    # The draft budget (engine/spec_decode/controller.py; the measurements behind each default are
    # in docs/speculative-decoding.md). No request speculates in a step with more than
    # `disable_by_batch_size` running requests (0: no limit; None: by the target's weights,
    # 4 with quantized small steps, whose extra rows are compute-bound, 2 for dense ones,
    # whose kernel steps up past four rows). Below that, a step gets the drafts whose expected
    # gain pays for their cost, as timed on this engine's own steps. Where a step size has not
    # been timed yet, one more verified row costs `row_cost` of a decode step's fixed cost
    # (None: by the target's weights; a value given here also turns the timing off) and one
    # draft token `draft_cost` (None: the proposer's own estimates, per token and for a draft
    # model's catch-up; 0 for n-gram). The expected gain comes from the acceptance learned
    # per kind of proposal over all requests (n-gram: its matched length; a draft model has
    # one kind), shrunk towards the request's own record.
    disable_by_batch_size: int | None = None
    row_cost: float | None = None
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            methods = ", ".join(SPEC_METHODS)
            raise ConfigError(f"speculative method must be one of {methods}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            k = self.num_speculative_tokens
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and not self.model:
            raise ConfigError("speculative method 'draft' needs 'model': the draft model's path or alias")
        if self.method != "draft" and self.model:
            raise ConfigError(f"'model' only applies to method 'draft', not {self.method!r}")
        if self.method != "self" and (self.draft_layers is not None or self.quantization is not None):
            raise ConfigError("'draft_layers' and 'quantization' only apply to method 'self'")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"draft_layers must be at least 1, got {self.draft_layers}")
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.method == "self" and self.draft_layers is None and self.quantization is None:
            raise ConfigError("method 'self' needs 'draft_layers' and/or 'quantization'")
        if (self.disable_by_batch_size or 0) < 0:
            raise ConfigError("disable_by_batch_size must be >= 0")
        if (self.row_cost is not None and self.row_cost < 0) or (
            self.draft_cost is not None and self.draft_cost < 0
        ):
            raise ConfigError("row_cost and draft_cost must be >= 0")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A dict (or its JSON text, as on the command line) -> config; unknown keys are errors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError("speculative config must be a JSON object / dict")
        # Keys of the per-request acceptance EMA, which the per-kind acceptance replaced.
        removed = sorted({"min_acceptance_rate", "acceptance_ema_decay", "probe_interval"} & set(value))
        if removed:
            raise ConfigError(
                f"speculative config key(s) {removed} were removed with the per-request acceptance "
                "EMA they tuned: acceptance is learned per kind of proposal, and the draft budget "
                "takes only the drafts that pay (docs/speculative-decoding.md)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ConfigError(f"speculative config needs 'method' (one of {', '.join(SPEC_METHODS)})")
        try:
            return cls(**value)
        except TypeError as exc:  # e.g. a string where a number belongs, in a comparison
            raise ConfigError(f"bad speculative config value: {exc}") from exc


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, built once."""

    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    # Weight form for steps of at most `small_step_max_rows` tokens (decode-heavy steps):
    # None keeps the dense weights everywhere (not quantized; a bf16 model's small steps read
    # them through the native bf16 kernel where it runs); "int8"/"int4" use weight-only
    # quantized kernels there; "auto": what the GGUF file carries (its own Q4 blocks become
    # int4, 5-8-bit types int8, float tensors stay dense; models/__init__.py). Larger steps
    # use the dense weights, or int8 x int8 (large_step_quantization).
    quantization: str | None = None
    # None: SMALL_STEP_MAX_ROWS, or SMALL_STEP_MAX_ROWS_W8A8 with large_step_quantization
    # "w8a8" (resolved at construction).
    small_step_max_rows: int | None = None
    # Weight form for the steps past the small-step limit (and of at least `large_step_min_rows`
    # tokens): prefill and bigger decode batches. None: dense (bf16 through oneDNN, the native
    # bf16 kernel up to 64 rows); "w8a8": int8 weights and int8 activations per token, after a
    # blockwise Hadamard rotation (layers/linear.py Int8Rotated): faster than bf16 from a dozen
    # rows up, for a small loss of perplexity (docs/performance.md). Needs dtype "bfloat16" and
    # the native kernel backend (else a ConfigError); where the native kernels cannot load the
    # dense weights serve the large steps, with a warning at load (layers/kernel_plan.py).
    large_step_quantization: str | None = None
    large_step_min_rows: int = 1  # 1: every step past the small-step limit
    # "int4": the LM head also gets an int4 form for steps of at most LM_HEAD_INT4_MAX_ROWS
    # rows (requantized from its weight), half the bytes of int8 for large vocabularies whose
    # head dominates a decode step (Gemma 3's 262k x 640); None: the head's forms as above.
    lm_head_quantization: str | None = None
    # "native": the compiled kernels (layers/native.py): decode and short query runs attend
    # over the paged cache in place, and norms, rotary and SiLU*up are one call each; torch
    # ops are the fallback when they cannot be built. "torch": torch ops only (gather, then
    # matmuls / SDPA; the reference path).
    kernel_backend: str = "native"
    # Compute threads of the engine (torch's intra-op pool, which the native kernels share).
    # None: every CPU this process may run on. In `fornax serve` the HTTP event loop gets no
    # core of its own by default: its work is short and runs while the kernels release the
    # GIL, and leaving it a core takes half the engine's threads on a 2-core machine
    # (docs/performance.md).
    num_threads: int | None = None
    # Batch-invariant numerics (docs/deterministic.md): a request's logits are a function of its
    # own tokens, whatever shares its steps, whatever the prefix cache holds, however its
    # prompt is chunked, with or without speculative decoding, at any thread count. Each Linear
    # keeps one weight form for every step size and every row attends through the paged-
    # attention kernel in parts of fixed size. Needs the native kernels, bfloat16 or float32.
    deterministic: bool = False
    # Tensor parallelism (docs/tensor-parallel.md): this many ranks each hold a slice of every
    # layer; the engine process is rank 0, workers are spawned here unless `distributed_init`
    # (tcp://host:port) names a group whose other ranks `fornax worker` starts elsewhere.
    # Every collective gives up after `distributed_timeout` seconds.
    tensor_parallel_size: int = 1
    distributed_init: str | None = None
    distributed_timeout: float = 60.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    seed: int = 0
    # How pooling (embedding) requests pool by default: "mean", "cls" or "last" over the final
    # hidden states; None: the model's own pooling config (config/pooling.py). A request may
    # ask for another.
    pooling: str | None = None
    # LoRA adapters over the model (config/lora.py; docs/lora.md); None: none can be served.
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be None, 'int8', 'int4' or 'auto', got {self.quantization!r}"
            )
        if self.small_step_max_rows is None:
            rows = SMALL_STEP_MAX_ROWS_W8A8 if self.large_step_quantization == "w8a8" else SMALL_STEP_MAX_ROWS
            object.__setattr__(self, "small_step_max_rows", rows)  # still being built
        if self.small_step_max_rows < 0:
            raise ConfigError("small_step_max_rows must be >= 0")
        if self.large_step_quantization not in LARGE_STEP_METHODS:
            names = ", ".join(repr(m) for m in LARGE_STEP_METHODS)
            raise ConfigError(
                f"large_step_quantization must be one of {names}, got {self.large_step_quantization!r}"
            )
        if self.large_step_min_rows < 1:
            raise ConfigError("large_step_min_rows must be >= 1")
        if self.lm_head_quantization not in LM_HEAD_METHODS:
            raise ConfigError(
                f"lm_head_quantization must be None or 'int4', got {self.lm_head_quantization!r}"
            )
        if self.large_step_quantization == "w8a8" and (
            self.dtype != "bfloat16" or self.kernel_backend != "native"
        ):
            raise ConfigError(
                "large_step_quantization 'w8a8' runs on the native kernels with bfloat16 activations: "
                f"it needs dtype 'bfloat16' and kernel_backend 'native' (got {self.dtype!r}, {self.kernel_backend!r})"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ConfigError(f"kernel_backend must be 'native' or 'torch', got {self.kernel_backend!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ConfigError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.deterministic:
            self._check_deterministic()
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.lora is not None and (self.tensor_parallel_size > 1 or self.deterministic):
            raise ConfigError(
                "LoRA adapters run in one process with the batch-variant forms: they cannot be combined "
                "with tensor parallelism or deterministic mode yet"
            )

    def _check_tensor_parallel(self) -> None:
        """What the tensor-parallel engine does not do yet, refused up front."""
        if self.offload.disk_dir is not None:
            raise ConfigError(
                "tensor parallelism does not support the KV disk tier yet (the host tier works)"
            )

    def _check_deterministic(self) -> None:
        """What deterministic mode cannot promise, refused at construction rather than broken
        quietly: its batch-invariant kernels are the native bf16 and float32 ones, and an LM head form for
        one- and two-row steps is a second form by construction."""
        if self.dtype == "float16" or self.kernel_backend != "native":
            raise ConfigError(
                "deterministic mode runs on the native kernels: it needs dtype 'bfloat16' or 'float32' "
                f"and kernel_backend 'native' (got {self.dtype!r}, {self.kernel_backend!r})"
            )
        if self.lm_head_quantization is not None:
            raise ConfigError(
                "deterministic mode keeps one weight form per layer for every step size; "
                "lm_head_quantization adds a second one for small steps"
            )
        if self.offload.dtype == "int8" and self.cache.kv_cache_dtype != "int8":
            raise ConfigError(
                "deterministic mode needs KV tiers that give back the bits they were given: an int8 "
                "offload dtype over a bf16 cache would make a restored prefix differ from a recomputed one"
            )

    def threads_per_process(self) -> int:
        """Compute threads of each engine process: num_threads, else the CPUs this process may
        run on (its affinity mask where the OS has one), shared among the tensor-parallel ranks."""
        if self.num_threads is not None:
            return self.num_threads
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cpus // self.tensor_parallel_size)

    @property
    def small_step_method(self) -> str | None:
        """Kernel for small steps, or None when the dense weights serve every step."""
        return self.quantization
