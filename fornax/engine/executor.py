"""How the model's steps run: in this process alone, or with worker ranks in lockstep.

The engine core and the model runner hold an `Executor` and call it unconditionally at the
points where other processes must follow a step (docs/architecture.md, rule 8): the KV sizes
once, each step's forward and host-tier copies, a self-draft's forward. `LocalExecutor` does
nothing at those points; the tensor-parallel one (engine/tensor_parallel.py) broadcasts them
to its ranks. The core never asks which it has, as vLLM's EngineCore takes an executor class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from fornax.config import EngineConfig
from fornax.layers.attention import SeqSpan

if TYPE_CHECKING:
    from fornax.engine.kv.offload.connector import TransferPlan
    from fornax.models.sharding import Shard

DraftStep = Callable[[torch.Tensor, torch.Tensor, list[SeqSpan]], None]


class Executor(Protocol):
    # This process's slice of the model for load_model (None: the whole model).
    shard: Shard | None
    # Whether the one-call native small step may run: it skips the layers' hooks, which carry a
    # rank's all-reduces.
    runs_native_step: bool
    # What tells the other processes to run a self-draft's step too (None: nobody to tell).
    draft_step_to_ranks: DraftStep | None

    def share_sizes(self, num_blocks: int, host_slots: int) -> None:
        """The KV cache's blocks and the host tier's slots, as sized here."""
        ...

    def send_transfers(self, plan: TransferPlan) -> None:
        """A step's host-tier copies, before its forward."""
        ...

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SeqSpan]) -> None:
        """A step's forward, just before this process runs it."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """One process runs the whole model: nothing to send."""

    shard: Shard | None = None
    runs_native_step = True
    draft_step_to_ranks: DraftStep | None = None

    def share_sizes(self, num_blocks: int, host_slots: int) -> None:
        pass

    def send_transfers(self, plan: TransferPlan) -> None:
        pass

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SeqSpan]) -> None:
        pass

    def close(self) -> None:
        pass


def make_executor(config: EngineConfig) -> Executor:
    """The executor `config` asks for; the tensor-parallel one starts its worker ranks, which
    load their slices while this process loads its own."""
    if config.tensor_parallel_size == 1:
        return LocalExecutor()
    from fornax.engine.tensor_parallel import TensorParallelExecutor

    return TensorParallelExecutor(config)
