"""This step's grammar masks, computed on a worker thread while the model's forward runs.

Every mask a step needs is known when the step is scheduled: a constrained sequence's
matcher already holds all its accepted tokens, and its drafts (if any) are fixed. So the
runner starts the masks before the forward and collects them before sampling; xgrammar
releases the GIL while it fills a mask, so the two overlap and the masks leave the step's
critical path (benchmarks/structured.py measures what is left).

Row numbers match the runner's logits: one row per sampled sequence (`sample`), and k + 1
rows per sequence verifying k drafts (`verify`); only constrained rows get a mask row.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fornax.engine.outputs import ScheduledRequest
from fornax.engine.structured.backend import allocate_bitmask


@dataclass
class GrammarMask:
    bitmask: torch.Tensor  # [r, vocab / 32] int32: bit set = token allowed
    rows: torch.Tensor  # [r] long: the logits row each mask row applies to


@dataclass
class StepMasks:
    sample: GrammarMask | None  # rows of the sampled logits; None: no constrained row
    verify: GrammarMask | None  # rows of the verification logits (k + 1 per sequence)


class MaskWorker:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started by the first constrained step
        # What overlapping buys, for benchmarks/structured.py: the worker's CPU seconds spent
        # filling masks, and the seconds the step still waited for them after its forward.
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
        start = time.thread_time()  # CPU time: wall time here would count waits for the GIL
        try:
            return self._fill_rows(sampling, verifying)
        finally:
            self.fill_seconds += time.thread_time() - start

    def _fill_rows(self, sampling: list[ScheduledRequest], verifying: list[ScheduledRequest]) -> StepMasks:
        sample = verify = None
        rows = [row for row, s in enumerate(sampling) if s.request.grammar is not None]
        if rows:
            bitmask = allocate_bitmask(len(rows), self.vocab_size)
            for i, row in enumerate(rows):
                sampling[row].request.grammar.fill(bitmask, i)  # type: ignore[union-attr]
            self.num_rows += len(rows)
            sample = GrammarMask(bitmask, torch.from_numpy(np.array(rows, dtype=np.int64)))
        spans, start = [], 0  # (first logits row, sequence) of each constrained verifier
        for s in verifying:
            if s.request.grammar is not None:
                spans.append((start, s))
            start += len(s.spec_token_ids) + 1
        if spans:
            num_rows = sum(len(s.spec_token_ids) + 1 for _, s in spans)
            bitmask = allocate_bitmask(num_rows, self.vocab_size)
            logits_rows: list[int] = []
            for first, s in spans:
                assert s.request.grammar is not None
                s.request.grammar.fill_drafts(bitmask, len(logits_rows), s.spec_token_ids)
                logits_rows.extend(range(first, first + len(s.spec_token_ids) + 1))
            self.num_rows += num_rows
            verify = GrammarMask(bitmask, torch.from_numpy(np.array(logits_rows, dtype=np.int64)))
        return StepMasks(sample, verify)
