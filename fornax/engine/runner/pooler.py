"""Pooled vectors of pooling (embedding) requests, from the hidden rows each step computes.

A pooling request's prompt runs through the model like any prefill; for a decoder it may be
split over several steps (chunked prefill), so pooling reads each chunk's rows as they come,
as `_prompt_logprobs` in model_runner.py reads them for prompt logprobs:

- mean: a float32 running sum over the chunks, divided by the prompt length at the end;
- cls: the row of position 0, kept from the chunk that holds it;
- last: the row of the prompt's last position, in the step that computes it.

A request that reads more than its last row starts each life at position 0 (the scheduler gives
it no cached prefix: Request.reads_every_position), so a chunk at position 0 starts its state
afresh, and a preempted request's state is dropped with it. The vector is then cut to
`dimensions` (Matryoshka) and L2-normalized when asked, in float32.

A cross-encoder (a model with a classifier head: models/bert_classifier.py) pools every request
by its [CLS] row, and the rows of the requests that end in a step go through the head together,
once per step (docs/architecture.md, rule 7): each request's "vector" is its scores.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fornax.engine.outputs import ModelRunnerOutput, ScheduledRequest


class Pooler:
    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # request id -> [hidden] float32: mean's running sum, or cls's first row
        self._state: dict[str, torch.Tensor] = {}
        # A cross-encoder's classifier: [N, hidden] [CLS] rows -> [N, num_labels] float32 scores.
        self.head = head

    def drop(self, request_ids: set[str]) -> None:
        """Forget finished, aborted and preempted requests (a preempted one starts over)."""
        for request_id in request_ids:
            self._state.pop(request_id, None)

    def __call__(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, ends: np.ndarray, out: ModelRunnerOutput
    ) -> None:
        """Fold this step's rows into each pooling request's state; put the vector of each
        whose prompt ends this step in `out.pooled`. hidden: [T, hidden] after the final norm."""
        pooling = [(i, s) for i, s in enumerate(items) if s.request.pooling_params is not None]
        if not pooling:
            return
        firsts = {i: int(ends[i]) - s.num_new_tokens + 1 for i, s in pooling}  # each chunk's first row
        mean = [(i, s) for i, s in pooling if s.request.pooling_params.pooling_type == "mean"]
        if mean:
            # Every mean request's rows of this step summed in one call: segment r collects item r's rows.
            rows = np.concatenate([np.arange(firsts[i], ends[i] + 1) for i, _ in mean])
            segments = np.repeat(np.arange(len(mean)), [s.num_new_tokens for _, s in mean])
            picked = hidden[torch.from_numpy(rows)].float()  # [rows, hidden]
            sums = torch.zeros(len(mean), hidden.shape[1], dtype=torch.float32)
            sums.index_add_(0, torch.from_numpy(segments), picked)  # [M, hidden]
            for r, (_, s) in enumerate(mean):
                rid = s.request.request_id
                before = self._state.get(rid) if s.start > 0 else None
                self._state[rid] = sums[r] if before is None else before + sums[r]
        for i, s in pooling:
            if s.request.pooling_params.pooling_type == "cls" and s.start == 0:
                row = hidden[firsts[i]].to(torch.float32, copy=True)  # a copy: the step's rows go
                self._state[s.request.request_id] = row
        if self.head is not None:
            self._score([s for _, s in pooling if s.samples], out)
            return
        for i, s in pooling:
            if s.samples:  # the step reaches the prompt's end
                out.pooled[s.request.request_id] = self._finish(s, hidden[int(ends[i])])

    def _score(self, ending: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        """The head's scores of every request whose prompt ends this step, in one call; their
        [CLS] rows were kept above (each resolved to cls pooling: engine/pooling.py)."""
        if not ending:
            return
        assert self.head is not None
        rows = torch.stack([self._state.pop(s.request.request_id) for s in ending])  # [N, hidden]
        scores = self.head(rows).tolist()  # [N, num_labels]
        for s, row in zip(ending, scores):
            out.pooled[s.request.request_id] = row

    def _finish(self, s: ScheduledRequest, last_row: torch.Tensor) -> list[float]:
        request = s.request
        params = request.pooling_params
        assert params is not None
        kind = params.pooling_type
        if kind == "last":
            vector = last_row.float()  # [hidden]
        else:
            vector = self._state.pop(request.request_id)
            if kind == "mean":
                vector = vector / request.num_prompt_tokens
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if params.normalize:
            vector = F.normalize(vector, dim=0)
        return vector.tolist()
