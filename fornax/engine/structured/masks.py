"""This step's grammar masks, filled on a worker thread while the model's forward runs.

Every mask a step needs is known when the step is scheduled: a constrained sequence's
matcher already holds all its accepted tokens, and its drafts (if any) are fixed. So the
runner hands them to a worker before the forward and collects them before sampling.

On this 2-core machine the forward takes every core, so the worker is not free: beside the
forward a mask costs ~65 us of CPU instead of ~3 us on a warm core. Filled after the forward
instead they cost ~100 us each on the critical path (its weights have evicted xgrammar's
tables from the caches). Side by side (benchmarks/structured.py, 2026-12-04) the worker won
at 1 and 16 streams: 0.923 vs 0.903 and 0.979 vs 0.951 of free decode. `overlap=False`
keeps the inline path for measurements like that one.

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


@dataclass
class _Deferred:
    """Masks to fill in `collect`, after the forward (overlap off)."""

    sampling: list[ScheduledRequest]
    verifying: list[ScheduledRequest]


class MaskWorker:
    def __init__(self, vocab_size: int, overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap  # False: fill the masks in `collect`, after the forward
        self._pool: ThreadPoolExecutor | None = None  # started by the first overlapped step
        # For benchmarks/structured.py: CPU seconds spent filling masks, and the seconds the
        # step spent on them after its forward (waiting, or filling them itself).
        self.num_steps = 0
        self.num_rows = 0  # constrained rows filled
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0

    def start(self, items: list[ScheduledRequest]) -> Future[StepMasks] | _Deferred | None:
        """Begin filling this step's masks (or note them for `collect`); None when no
        scheduled sequence is constrained."""
        if all(s.request.grammar is None for s in items):
            return None
        sampling = [s for s in items if s.samples and not s.spec_token_ids]
        verifying = [s for s in items if s.spec_token_ids]
        if not self.overlap:
            return _Deferred(sampling, verifying)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fornax-grammar")
        return self._pool.submit(self._fill, sampling, verifying)

    def collect(self, pending: Future[StepMasks] | _Deferred | None) -> StepMasks:
        """The step's masks: those `start` began (waiting if the forward was quicker), or
        filled now."""
        if pending is None:
            return StepMasks(None, None)
        start = time.perf_counter()
        masks = (
            self._fill(pending.sampling, pending.verifying)
            if isinstance(pending, _Deferred)
            else pending.result()
        )
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
                sampling[row].request.grammar.fill(bitmask, i)
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
