"""LoRA slots on a Linear, and the low-rank products of one step (docs/lora.md).

A Linear of the base model may carry `LoRASlots`: the A and B matrices of up to `max_loras`
adapters, each in a slot, sized once for the largest rank allowed (zeros where an adapter is
smaller or does not target this projection). A step's rows may belong to different adapters
or to none; the products are added on top of whatever form the base step ran (dense,
int4/int8, w8a8), the base weights never merged or copied. The scaling (lora_alpha / r, or
/ sqrt(r) for rsLoRA) is folded into B when an adapter is written into a slot, as vLLM does.
Two ways to compute them, neither a loop over requests or adapters in Python:

- the native kernel (kernels/lora.c, where the library builds): one call per projection that
  computes each adapted row's B_p (A_p x) of its own adapter straight from the slots, as
  Punica's SGMV kernels do on a GPU; the one-call decode step calls it too;
- torch (no native kernels): one gathered shrink and one expand over the step's adapters,

      u = x @ A_active^T        [T, S*P*R]  every row against every adapter of the step
      u *= row_mask             zero where the row is not that adapter's (skipped when
                                every row has the same adapter)
      y += u @ B_active         [T, out]    B block-diagonal over the fused parts (q/k/v)

  S times the arithmetic each row needs (S, the step's adapters, is at most the slots), but
  two dense matmuls whatever the mix.

The products run in float32 whatever the model's dtype: on a CPU without native bf16 (AVX2),
torch's bf16 matmul is ~30x slower than its float32 one at these shapes (16 rows x 576 x 192:
4.4 ms against 0.14 ms, AMD EPYC Zen 2), and the slots are small enough that their float32
bytes do not matter beside the base weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fornax.layers.native import LoRAKernel


@dataclass
class LoRAStep:
    """Which adapter each row of the current step uses, as the adapted Linears read it.

    active: the slots used by some row (sorted), rank: the largest rank among them (the slots'
    columns past it are zeros for every active adapter, so they are skipped), mask: [T, S] 1.0
    where row t uses active[s]. key identifies the gathered weights (slots, rank, contents)."""

    active: torch.Tensor  # [S] int64
    rank: int
    mask: torch.Tensor | None  # [T, S] float32; None: every row uses active[0]
    key: tuple
    row_slot: torch.Tensor  # [T] int32: each row's slot, -1 for the base model (the native kernel's)

    @staticmethod
    def build(
        slots: Sequence[int | None],
        rows: Sequence[int],
        ranks: dict[int, int],
        version: int,
    ) -> LoRAStep | None:
        """The mapping for a step: `slots` and `rows` per scheduled request (None: the base
        model), `ranks` of the slots in use. None when no row is adapted."""
        active = sorted({s for s in slots if s is not None})
        if not active:
            return None
        uniform = len(active) == 1 and None not in slots
        per_row = np.repeat(np.array([-1 if s is None else s for s in slots]), rows)
        mask = None if uniform else torch.from_numpy(per_row[:, None] == np.array(active)[None, :]).float()
        rank = max(ranks[s] for s in active)
        row_slot = torch.from_numpy(per_row.astype(np.int32))
        return LoRAStep(torch.tensor(active), rank, mask, (tuple(active), rank, version), row_slot)


@dataclass
class LoRAStepState:
    """Shared by every LoRASlots of a model: the runner sets `current` around a forward that
    has adapted rows, and leaves it None otherwise (a draft's forward, a base-only step)."""

    current: LoRAStep | None = None
    # Bumped whenever a slot's contents change, so gathered weights are never stale.
    version: int = 0


@dataclass
class LoRASlots:
    """The adapters' matrices for one Linear whose output rows are `parts` (row counts of the
    fused projections, e.g. q, k, v) over `in_features` inputs. `kernel`: kernels/lora.c, which
    computes each adapted row's products from the slots in place (layers/native.py); None: the
    two matmuls in torch."""

    state: LoRAStepState
    in_features: int
    parts: tuple[int, ...]
    max_loras: int
    max_rank: int
    kernel: LoRAKernel | None = None
    a: torch.Tensor = field(init=False)  # [slots, P, R, in]
    # [slots, R, out]: each part's B^T in its own columns (scaling folded in)
    b: torch.Tensor = field(init=False)
    _gathered: tuple[tuple, torch.Tensor, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        out = sum(self.parts)
        self.a = torch.zeros(
            self.max_loras, len(self.parts), self.max_rank, self.in_features, dtype=torch.float32
        )
        self.b = torch.zeros(self.max_loras, self.max_rank, out, dtype=torch.float32)
        edges = [0, *itertools.accumulate(self.parts)]
        self.bounds = list(itertools.pairwise(edges))
        self.bounds_tensor = torch.tensor(edges, dtype=torch.int32)

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Put an adapter's (A [r, in], B [out_part, r]) per part into `slot`; None: the part is
        not adapted (zeros)."""
        self.clear(slot)
        for (lo, hi), i, pair in zip(self.bounds, itertools.count(), parts):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, i, :r].copy_(a)
            # (B * s) x A: the scale once here instead of a multiply per step
            self.b[slot, :r, lo:hi].copy_((b.float() * scaling).t())

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self._gathered = None

    def _weights(self, step: LoRAStep) -> tuple[torch.Tensor, torch.Tensor]:
        """A of the step's adapters as one [in, S*P*R] matrix, B as one [S*P*R, out] matrix,
        block-diagonal over the parts: gathered once per distinct set of adapters, not per call
        (consecutive steps mostly repeat their set)."""
        if self._gathered is not None and self._gathered[0] == step.key:
            return self._gathered[1], self._gathered[2]
        r, s = step.rank, step.active.shape[0]
        a = self.a.index_select(0, step.active)[:, :, :r].reshape(-1, self.in_features).t().contiguous()
        b = torch.zeros(s, len(self.parts), r, self.b.shape[2], dtype=torch.float32)
        chosen = self.b.index_select(0, step.active)[:, :r]
        for i, (lo, hi) in enumerate(self.bounds):
            b[:, i, :, lo:hi] = chosen[:, :, lo:hi]
        b = b.reshape(-1, self.b.shape[2])
        self._gathered = (step.key, a, b)
        return a, b

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's adapter product; y itself when the step
        has no adapted rows."""
        step = self.state.current
        if step is None:
            return y
        if self.kernel is not None and self.kernel.supports(y.dtype) and x.dtype == y.dtype:
            self.kernel(x, y, self.a, self.b, step.row_slot, self.bounds_tensor, step.rank)
            return y
        a, b = self._weights(step)
        u = x.float() @ a  # shrink: [T, S*P*R]
        if step.mask is not None:  # rows of other adapters (or none) keep zeros
            t, s = x.shape[0], step.active.shape[0]
            u = (u.view(t, s, -1) * step.mask.view(t, s, 1)).view(t, -1)
        if y.dtype == torch.float32:
            return y.addmm_(u, b)  # expand
        return y.add_(u @ b)  # expand in float32, rounded once into the model's dtype
