"""Turns the core's step state into lifecycle events for the EventBus (engine thread only).

The tap reads the engine through `EngineView`, the few queries EngineCore answers for it, and
never imports EngineCore: core.py -> event_tap.py is the only import between the two.

EngineCore calls this only after checking `bus.active`, so nothing here runs (and no state
here grows) while nobody watches. State kept across steps, per sequence: how many blocks
it held (to report only new ones), when its last token came (inter-token latency), and
whether it is known to be running (to report admission once per admission). When the bus
goes idle and active again, that state may be stale: it is dropped (`bus.generation`).
"""

from __future__ import annotations

import time
from typing import Protocol

from fornax.engine.events import Event, EventBus
from fornax.engine.outputs import EngineOutput, SchedulerOutput
from fornax.engine.request import Request, SamplingParams
from fornax.engine.stats import EngineStats


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class EngineView(Protocol):
    """What the tap reads of the engine (EngineCore implements it), called between two of its
    steps' stages in the engine thread."""

    @property
    def tokenizer(self) -> TokenBytes: ...

    def stats(self) -> EngineStats: ...

    def sequence_key(self, child_id: str) -> tuple[str, int]:
        """(the user's request id, sample index) of an engine sequence id."""
        ...

    def find_sequence(self, request_id: str, index: int) -> Request | None: ...

    def block_ids(self, child_id: str) -> list[int]: ...


class EventTap:
    def __init__(self, bus: EventBus, block_size: int) -> None:
        self.bus, self.block_size = bus, block_size
        self.step_id = 0  # counts steps seen while watched; labels batches in the UI
        self._generation = -1
        self._blocks: dict[str, int] = {}  # child id -> blocks it held after its last step
        self._last_token: dict[tuple[str, int], float] = {}  # (parent, index) -> monotonic time
        self._chunks: list[tuple[Request, str, int, int, int]] = []  # this step's prefill chunks
        # this step's verifications: (request, parent, index, its blocks while verifying, drafts,
        # drafts it had had accepted before this step)
        self._verifying: list[tuple[Request, str, int, list[int], int, int]] = []
        self._step_start = 0.0

    def _sync(self) -> None:
        if self._generation != self.bus.generation:
            self._generation = self.bus.generation
            self._blocks.clear()
            self._last_token.clear()

    # -- hooks called by EngineCore --
    def on_add(
        self,
        core: EngineView,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> None:
        """adapter: the LoRA adapter it runs with (docs/lora.md), shown by the request view."""
        self._sync()
        stats = core.stats()
        data = {
            "num_prompt_tokens": len(prompt),
            "n": params.n,
            "max_tokens": params.max_tokens,
            "position": stats.num_waiting - 1,
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
        }
        if adapter is not None:
            data["adapter"] = adapter
        self.bus.publish([Event("queued", request_id, time.time(), data)])

    def on_schedule(self, core: EngineView, sched: SchedulerOutput) -> None:
        """After schedule(), before the forward pass: admissions, new blocks, preemptions."""
        self._sync()
        self.step_id += 1
        self._step_start = time.monotonic()
        now = time.time()
        stats = core.stats()  # after schedule(): admissions and allocations are done
        events: list[Event] = []
        batch = [s.request.request_id for s in sched.scheduled]
        for child_id in sched.finished_request_ids:  # finished or aborted since the last step
            self._blocks.pop(child_id, None)
        for child_id in sched.preempted_request_ids:
            self._blocks.pop(child_id, None)
            parent, index = core.sequence_key(child_id)
            events.append(Event("preempted", parent, now, {"index": index}))
        self._chunks = []
        self._verifying = []
        for s in sched.scheduled:
            req, child_id = s.request, s.request.request_id
            parent, index = core.sequence_key(child_id)
            if s.spec_token_ids:
                spec = (list(s.block_ids), len(s.spec_token_ids), req.spec.num_accepted_tokens)
                self._verifying.append((req, parent, index, *spec))
            held = self._blocks.get(child_id)
            start = req.num_computed_tokens  # before this step's tokens
            if held is None:  # admitted (or readmitted after preemption) this step
                cached = start // self.block_size  # prefix hits are whole blocks, all at the front
                events.append(
                    Event(
                        "scheduled",
                        parent,
                        now,
                        {
                            "index": index,
                            "step": self.step_id,
                            "batch_size": len(batch),
                            "batch": [core.sequence_key(b)[0] for b in batch if b != child_id],
                            "num_running": stats.num_running,
                            "num_waiting": stats.num_waiting,
                            "num_cached_tokens": start,
                        },
                    )
                )
                events.append(
                    Event(
                        "blocks",
                        parent,
                        now,
                        {
                            "index": index,
                            "new": s.block_ids[cached:],
                            "cached": s.block_ids[:cached],
                            "table": list(s.block_ids),
                            "num_free_blocks": stats.num_free_kv_blocks,
                            "tiers": _tiers(sched, child_id, s.block_ids),
                        },
                    )
                )
            elif len(s.block_ids) > held:
                events.append(
                    Event(
                        "blocks",
                        parent,
                        now,
                        {
                            "index": index,
                            "new": s.block_ids[held:],
                            "cached": [],
                            "table": list(s.block_ids),
                            "num_free_blocks": stats.num_free_kv_blocks,
                        },
                    )
                )
            self._blocks[child_id] = len(s.block_ids)
            end = start + s.num_new_tokens
            if start < req.num_prompt_tokens:  # a prompt chunk (or a recompute after preemption)
                self._chunks.append((req, parent, index, start, end))
        self.bus.publish(events)

    def on_outputs(self, core: EngineView, outputs: list[EngineOutput]) -> None:
        """After update: the prefill chunks just computed, the tokens sampled, the finishes."""
        self._sync()
        mono, now = time.monotonic(), time.time()
        events: list[Event] = []
        for req, parent, index, start, end in self._chunks:
            events.append(
                Event(
                    "prefill_chunk",
                    parent,
                    now,
                    {
                        "index": index,
                        "step": self.step_id,
                        "start": start,
                        "end": end,
                        "num_prompt_tokens": req.num_prompt_tokens,
                        "duration_s": mono - self._step_start,
                    },
                )
            )
        self._chunks = []
        stats = core.stats()  # after update: rejected drafts' blocks are back in the pool
        for req, parent, index, held, drafts, accepted_before in self._verifying:
            # Rejected drafts are rolled back and the blocks that held only them go back to the
            # pool (Scheduler._settle_drafts); a finished request frees everything on its own.
            after = core.block_ids(req.request_id) if not req.is_finished else held
            events.append(
                Event(
                    "spec_verify",
                    parent,
                    now,
                    {
                        "index": index,
                        "step": self.step_id,
                        "num_draft_tokens": drafts,
                        "num_accepted_tokens": req.spec.num_accepted_tokens - accepted_before,
                        "released_blocks": held[len(after) :],
                        "num_free_blocks": stats.num_free_kv_blocks,
                    },
                )
            )
            self._blocks[req.request_id] = len(after)
        self._verifying = []
        tokenizer = core.tokenizer
        for out in outputs:
            key = (out.request_id, out.index)
            last = self._last_token.get(key)
            for pos, token in enumerate(out.new_token_ids):
                lp = out.new_logprobs[pos] if pos < len(out.new_logprobs) else None
                data = {
                    "index": out.index,
                    "step": self.step_id,
                    "token_id": token,
                    "text": out.new_text if pos == len(out.new_token_ids) - 1 else "",
                    "bytes": tokenizer.token_bytes(token).hex(),
                    "logprob": None if lp is None else lp.logprob,
                    "itl_s": None if last is None else mono - last,
                    "batch_size": stats.last_step_num_seqs,
                }
                if last is None:
                    data["ttft_s"] = _ttft(core, out)
                events.append(Event("token", out.request_id, now, data))
                last = mono
            if out.finished:
                self._last_token.pop(key, None)
                events.append(
                    Event(
                        "finished",
                        out.request_id,
                        now,
                        {
                            "index": out.index,
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                            "num_prompt_tokens": out.num_prompt_tokens,
                            "num_cached_tokens": out.num_cached_tokens,
                            "timings": out.timings or {},
                        },
                    )
                )
            elif last is not None:
                self._last_token[key] = last
        self.bus.publish(events)


def _ttft(core: EngineView, out: EngineOutput) -> float | None:
    """Arrival to first token, if `out` carries the sequence's first token (else None: the bus
    went active in the middle of the request, so this is merely the first token seen)."""
    if out.timings is not None:  # already finished (and forgotten by the scheduler)
        return out.timings.get("ttft_s")
    req = core.find_sequence(out.request_id, out.index)
    if req is not None and req.num_output_tokens == 1 and req.times.first_token is not None:
        return req.times.first_token - req.times.arrival
    return None


def _tiers(sched: SchedulerOutput, child_id: str, block_ids: list[int]) -> dict[str, str]:
    """Block id -> the KV tier its contents were loaded from this step ("host", "disk", "swap");
    cached blocks not named here are primary prefix-cache hits."""
    plan = sched.kv_transfers
    loaded = plan.sources.get(child_id) if plan is not None else None
    if loaded is None:
        return {}
    first, tiers = loaded
    return {str(block_ids[first + i]): tier for i, tier in enumerate(tiers)}
