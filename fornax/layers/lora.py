"""LoRA slots on a Linear, and the batched low-rank product of one step (docs/lora.md).

A Linear of the base model may carry `LoRASlots`: the A and B matrices of up to `max_loras`
adapters, each in a slot, sized once for the largest rank allowed (zeros where an adapter is
smaller or does not target this projection). A step's rows may belong to different adapters
or to none. Rather than a loop over requests or adapters, each adapted Linear runs one
gathered shrink and one expand, as Punica's segmented kernels do on a GPU:

    u = x @ A_active^T              [T, S*P*R]  every row against every adapter of the step
    u *= row_mask                   zero where the row is not that adapter's (skipped when
                                    every row has the same adapter)
    y += u @ B_active               [T, out]    B block-diagonal over the fused parts (q/k/v)

S, the adapters in the step, is small (the slots), so computing each row against all of
them costs S times the rank, and keeps the whole product two dense matmuls: at decode, where
a step is a few rows, the count of calls matters more than their arithmetic. The base weights
are never merged or copied: the product is added on top of whatever form the base step ran
(dense, int4/int8, w8a8). The scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded
into B when an adapter is written into a slot, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LoRAStep:
    """Which adapter each row of the current step uses, as the adapted Linears read it.

    active: the slots used by some row (sorted), rank: the largest rank among them (the slots'
    columns past it are zeros for every active adapter, so they are skipped), mask: [T, S] 1.0
    where row t uses active[s]. key identifies the gathered weights (slots, rank, contents)."""

    active: torch.Tensor  # [S] int64
    rank: int
    mask: torch.Tensor | None  # [T, S] in the model's dtype; None: every row uses active[0]
    key: tuple

    @staticmethod
    def build(
        slots: Sequence[int | None],
        rows: Sequence[int],
        ranks: dict[int, int],
        version: int,
        dtype: torch.dtype,
    ) -> LoRAStep | None:
        """The mapping for a step: `slots` and `rows` per scheduled request (None: the base
        model), `ranks` of the slots in use. None when no row is adapted."""
        active = sorted({s for s in slots if s is not None})
        if not active:
            return None
        uniform = len(active) == 1 and None not in slots
        per_row = np.repeat(np.array([-1 if s is None else s for s in slots]), rows)
        mask = None if uniform else torch.from_numpy(per_row[:, None] == np.array(active)[None, :]).to(dtype)
        rank = max(ranks[s] for s in active)
        return LoRAStep(torch.tensor(active), rank, mask, (tuple(active), rank, version))


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
    fused projections, e.g. q, k, v) over `in_features` inputs."""

    state: LoRAStepState
    in_features: int
    parts: tuple[int, ...]
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    a: torch.Tensor = field(init=False)  # [slots, P, R, in]
    b: list[torch.Tensor] = field(init=False)  # per part: [slots, R, out_part] (scaling folded in)
    _gathered: tuple[tuple, torch.Tensor, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        p = len(self.parts)
        self.a = torch.zeros(self.max_loras, p, self.max_rank, self.in_features, dtype=self.dtype)
        self.b = [torch.zeros(self.max_loras, self.max_rank, n, dtype=self.dtype) for n in self.parts]
        self.bounds = []
        start = 0
        for n in self.parts:
            self.bounds.append((start, start + n))
            start += n

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Put an adapter's (A [r, in], B [out_part, r]) per part into `slot`; None: the part is
        not adapted (zeros)."""
        self.a[slot].zero_()
        for i, pair in enumerate(parts):
            self.b[i][slot].zero_()
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, i, :r].copy_(a)
            # (B * s) x A: the scale once here instead of a multiply per step
            self.b[i][slot, :r].copy_((b.float() * scaling).t())
        self._gathered = None

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        self._gathered = None

    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b)

    def _weights(self, step: LoRAStep) -> tuple[torch.Tensor, torch.Tensor]:
        """A of the step's adapters as one [in, S*P*R] matrix, B as one [S*P*R, out] matrix,
        block-diagonal over the parts: gathered once per distinct set of adapters, not per call
        (consecutive steps mostly repeat their set)."""
        if self._gathered is not None and self._gathered[0] == step.key:
            return self._gathered[1], self._gathered[2]
        r, s = step.rank, step.active.shape[0]
        a = self.a.index_select(0, step.active)[:, :, :r].reshape(-1, self.in_features).t().contiguous()
        b = torch.zeros(s, len(self.parts), r, self.bounds[-1][1], dtype=self.dtype)
        for i, (lo, hi) in enumerate(self.bounds):
            b[:, i, :, lo:hi] = self.b[i].index_select(0, step.active)[:, :r]
        b = b.reshape(-1, self.bounds[-1][1])
        self._gathered = (step.key, a, b)
        return a, b

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's adapter product; y itself when the step
        has no adapted rows."""
        step = self.state.current
        if step is None:
            return y
        a, b = self._weights(step)
        u = x @ a  # shrink: [T, S*P*R]
        if step.mask is not None:  # rows of other adapters (or none) keep zeros
            t, s = x.shape[0], step.active.shape[0]
            u = (u.view(t, s, -1) * step.mask.view(t, s, 1)).view(t, -1)
        return y.addmm_(u, b)  # expand
