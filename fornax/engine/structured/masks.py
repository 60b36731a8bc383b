"""This step's grammar masks, computed on a worker thread while the model's forward runs.

Every mask a step needs is known when the step is scheduled: a constrained sequence's
matcher already holds all its accepted tokens, and its drafts (if any) are fixed. So the
runner starts the masks before the forward and collects them before sampling; xgrammar
releases the GIL while it fills a mask, so the two overlap and the masks leave the step's
critical path (benchmarks/structured.py measures what is left).

Row order matches the runner's: one row per sampled sequence (`sample`), and k + 1 rows per
sequence verifying k drafts (`verify`). Rows of unconstrained sequences keep every bit set.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fornax.engine.outputs import ScheduledRequest
from fornax.engine.structured.backend import allocate_bitmask


@dataclass
class StepMasks:
    sample: torch.Tensor | None  # [num_sampled, vocab / 32] int32, or None: no constrained row
    verify: torch.Tensor | None  # [sum(k + 1), vocab / 32] int32, or None


class MaskWorker:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started by the first constrained step
        # What overlapping buys, for benchmarks/structured.py: seconds spent filling masks on
        # the worker, and seconds the step still waited for them after its forward.
        self.num_steps = 0
        self.num_rows = 0  # constrained rows filled
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0

    def start(self, items: list[ScheduledRequest]) -> Future[StepMasks] | None:
        """Begin filling this step's masks; None when no scheduled sequence is constrained."""
        if all(s.request.grammar is None for s in items):
            return None
        sampling = [s for s in items if s.samples and not s.spec_token_ids]
        verifying = [s for s in items if s.spec_token_ids]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fornax-grammar")
        return self._pool.submit(self._fill, sampling, verifying)

    def collect(self, pending: Future[StepMasks] | None) -> StepMasks:
        """The masks `start` began (waiting for them if the forward was quicker)."""
        if pending is None:
            return StepMasks(None, None)
        start = time.perf_counter()
        masks = pending.result()
        self.wait_seconds += time.perf_counter() - start
        self.num_steps += 1
        return masks

    def _fill(self, sampling: list[ScheduledRequest], verifying: list[ScheduledRequest]) -> StepMasks:
        start = time.perf_counter()
        try:
            return self._fill_rows(sampling, verifying)
        finally:
            self.fill_seconds += time.perf_counter() - start

    def _fill_rows(self, sampling: list[ScheduledRequest], verifying: list[ScheduledRequest]) -> StepMasks:
        sample = verify = None
        if any(s.request.grammar is not None for s in sampling):
            sample = allocate_bitmask(len(sampling), self.vocab_size)
            for row, s in enumerate(sampling):
                if s.request.grammar is not None:
                    s.request.grammar.fill(sample, row)
                    self.num_rows += 1
        if any(s.request.grammar is not None for s in verifying):
            verify = allocate_bitmask(sum(len(s.spec_token_ids) + 1 for s in verifying), self.vocab_size)
            row = 0
            for s in verifying:
                if s.request.grammar is not None:
                    s.request.grammar.fill_drafts(verify, row, s.spec_token_ids)
                    self.num_rows += len(s.spec_token_ids) + 1
                row += len(s.spec_token_ids) + 1
        return StepMasks(sample, verify)
