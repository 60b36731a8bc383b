"""The KV connector interface: how tiers below the primary pool plug into the engine.

Shaped like vLLM's KV connector (vllm/distributed/kv_transfer), split the same way:

* the scheduler side answers, while a step is being scheduled, how many more tokens a tier can
  supply for a request past its primary-cache hit, is told where those tokens' blocks were
  allocated, hears of blocks leaving the primary pool (evicted, freed by a finished request,
  swapped out by a preemption), and at the end of schedule() turns all of that into one
  `TransferPlan` that travels to the runner on the SchedulerOutput;
* the worker side carries the plan out before the step's forward pass (saves first, since a
  block saved this step may be the target of a load or of the forward's own writes), and
  reports what finished.

The scheduler's own logic does not change with a connector: it asks, allocates as before, and
counts the supplied tokens as computed (engine/scheduler.py). Pure bookkeeping here: no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fornax.engine.kv.block_pool import BlockHash

if TYPE_CHECKING:
    from collections.abc import Callable

    from fornax.engine.request import Request


@dataclass
class DiskLoad:
    """A block read from disk (its checksum already verified) bound for a primary block."""

    block_id: int
    payload: bytes


@dataclass
class TransferPlan:
    """One step's KV movements, in the order the worker must carry them out."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (primary block id, host slot)
    disk_loads: list[DiskLoad] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, primary block id)
    writes: list[tuple[BlockHash, int]] = field(default_factory=list)  # host slots to persist
    unpin: list[int] = field(default_factory=list)  # host slots held for this plan's loads
    release_swaps: list[str] = field(default_factory=list)  # swapped-in requests: free their slots after
    # request id -> where each loaded block of its table comes from ("host", "disk", "swap"),
    # starting at `table[first]`: (first, tiers). For live views; the copies ignore it.
    sources: dict[str, tuple[int, list[str]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.saves or self.disk_loads or self.loads or self.writes or self.unpin or self.release_swaps
        )


class KVConnector(ABC):
    """Scheduler side and worker side of one tier stack (a single process holds both)."""

    # -- scheduler side --
    def bind_block_hashes(self, block_hash: Callable[[Request, int], BlockHash]) -> None:
        """The primary cache's (memoized) hash chain: tiers key blocks exactly as it does."""
        self.block_hash = block_hash

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (the primary-cache hit) a tier can supply: whole
        blocks, never the request's last token (its logits are needed)."""

    @abstractmethod
    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int] | None,
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> int:
        """After the allocation that followed a lookup (None: it failed and nothing happens):
        bind the matched blocks to `block_ids` from token `num_computed_tokens` on. Returns the
        tokens that will really be loaded (fewer if a disk chunk failed its checksum)."""

    @abstractmethod
    def on_blocks_evicted(self, evicted: list[tuple[BlockHash, int]]) -> None:
        """Cached blocks the primary pool just handed out again: their contents are intact until
        this step's forward pass."""

    @abstractmethod
    def request_finished(self, request: Request, cached_blocks: list[tuple[BlockHash, int]]) -> None:
        """A request finished or was aborted; `cached_blocks` are its full, hashed blocks."""

    @abstractmethod
    def swap_out(self, request: Request, block_ids: list[int], num_tokens: int) -> bool:
        """Preemption: keep the request's first `num_tokens` tokens of K/V (in `block_ids`)
        outside the primary pool; False when there is no room (the request recomputes)."""

    @abstractmethod
    def num_swapped_tokens(self, request: Request) -> int:
        """Tokens of the request held by a swap-out (0: none); they are loaded back by
        `update_state_after_alloc` like a tier hit."""

    @abstractmethod
    def build_connector_meta(self) -> TransferPlan | None:
        """Everything decided since the last call, as one plan (None: nothing to move)."""

    # -- worker side --
    @abstractmethod
    def start_load_kv(self, plan: TransferPlan, kv_cache: Any) -> None:
        """Carry out the plan on the primary pool's tensors before the forward pass."""

    @abstractmethod
    def get_finished(self) -> int:
        """Collect the transfers that completed in the background since the last call (disk
        writes), releasing what they held; how many."""

    # -- life --
    @abstractmethod
    def close(self, kv_cache: Any) -> None:
        """Save what finished requests left and flush pending disk writes (server shutdown)."""

    @abstractmethod
    def stats(self) -> Any:
        """Counters and occupancy for metrics."""

    def check_integrity(self) -> None:
        """Assert the connector's own invariants (tests); by default there are none to check."""
        return None

    def memory_tensors(self) -> list[Any]:
        """The tensors this connector holds in memory (the memory breakdown, engine/memory_report.py)."""
        return []
