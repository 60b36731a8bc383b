"""What the engine asks of a model, and the K/V pools every architecture writes.

`CausalLM` is the interface the engine calls (the runner's step, the draft proposer, the
memory report, the loader's weight forms): every decoder in `models.ARCHITECTURES` provides it,
and the engine annotates with it rather than with one architecture's class. Code that works
on the Llama family's own structure (the one-call native step, a self-draft cut from the
target's layers, a rank's slice) names `LlamaForCausalLM` instead. `EncoderModel` is what an
encoder (BERT) offers instead: pooling requests only, whole sequences, no K/V.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fornax.config import ModelConfig
from fornax.layers.attention import AttentionMetadata
from fornax.layers.encoder_attention import EncoderMetadata
from fornax.layers.kv_pool import LayerKV, bytes_per_token
from fornax.layers.linear import Linear
from fornax.layers.ops import LayerOps


class LinearForms(nn.Module):
    """What the loader and the memory report ask of any model's projections (layers/linear.py):
    the decoders and the encoders share these answers, so they are written once."""

    def has_small_step_forms(self) -> bool:
        """Whether any projection has a form of its own for small steps (layers/linear.py)."""
        return any(isinstance(m, Linear) and m.small is not None for m in self.modules())

    def has_quantized_small_steps(self) -> bool:
        """Whether any projection's small-step form is quantized (not the dense bf16 kernel)."""
        return any(
            isinstance(m, Linear) and m.small is not None and m.small.quantized for m in self.modules()
        )

    def has_int8_large_steps(self) -> bool:
        """Whether the steps past the small-step limit run int8 x int8 (layers/linear.py Int8Rotated)."""
        return any(isinstance(m, Linear) and m.large is not None for m in self.modules())


class KVCache:
    """Per-layer K and V pools (layers/kv_pool.py): [num_blocks * block_size, num_kv_heads, head_dim]
    each, in the model's dtype or (kv_cache_dtype "int8") as int8 rows with scales."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> None:
        num_slots = num_blocks * block_size
        self.layers = LayerKV.allocate_layers(
            config.num_hidden_layers,
            num_slots,
            config.num_key_value_heads,
            config.head_dim,
            dtype,
            kv_cache_dtype,
        )
        self.num_blocks, self.block_size, self.kv_cache_dtype = num_blocks, block_size, kv_cache_dtype

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        per_token = bytes_per_token(config.num_key_value_heads, config.head_dim, dtype, kv_cache_dtype)
        return per_token * block_size * config.num_hidden_layers


@runtime_checkable
class CausalLM(Protocol):
    """A decoder over flat paged batches: tokens of many sequences end to end, their positions
    and the step's attention metadata in; hidden states out, logits for the sampled rows."""

    config: ModelConfig
    dtype: torch.dtype

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """[T] token ids, [T] positions -> hidden states after the final norm, [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        ...

    def use_ops(self, ops: LayerOps) -> None: ...

    def linear_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each Linear with the HF weight names fused into it: what loading and quantization read."""
        ...

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def has_small_step_forms(self) -> bool: ...

    def has_quantized_small_steps(self) -> bool: ...

    def has_int8_large_steps(self) -> bool: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


@runtime_checkable
class EncoderModel(Protocol):
    """A bidirectional encoder over flat batches (ModelConfig.encoder; models/bert.py): each
    sequence computed whole in one step, no K/V kept, no LM head. The runner pools its hidden
    states for pooling requests; it serves no generation."""

    config: ModelConfig
    dtype: torch.dtype

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: EncoderMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] token ids, [T] positions (from 0 in each sequence), [T] token types (None: all 0)
        -> final hidden states, [T, hidden]."""
        ...

    def use_ops(self, ops: LayerOps) -> None: ...

    def linear_sources(self) -> list[tuple[Linear, list[str]]]: ...

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def modules(self) -> Iterator[nn.Module]: ...
