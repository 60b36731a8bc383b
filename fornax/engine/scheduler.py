"""Token-budget continuous batching: which requests compute how many tokens this step.

Pure bookkeeping, no torch (docs/architecture.md, rule 1). One phase model (rule 2): each request's
`num_computed_tokens` catches up with its `num_tokens`; a step gives a request
`num_new_tokens` of that gap. A prompt that does not fit the budget is split over steps
(chunked prefill); decodes are gaps of 1; both mix freely in one batch.

A step is:  schedule() -> runner executes -> update_from_output().
schedule() never advances num_computed_tokens (ScheduledRequest.start reads it);
update_from_output() does, once the tokens are really computed.

Every release of KV blocks (finish, abort, preemption) goes through `_free` (rule 6).

Pooling (embedding) requests are prefill-only (engine/pooling.py): scheduled like any prompt,
finished in the step that computes their last prompt token. An encoder's prompt is never split
(`Request.whole_prompt`): it is admitted whole or waits for a step with room.

With KV tiers (engine/kv/offload) a connector supplies more of a request's prefix than the
primary cache holds: those tokens are allocated like any others and count as computed, and the
connector's plan for the step (what to save, what to load) rides on the SchedulerOutput.
Preemption can swap a request's blocks out instead of dropping them (`swap` below).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterator

from fornax.config import CacheConfig, SchedulerConfig
from fornax.engine.kv.manager import KVCacheManager, cdiv
from fornax.engine.kv.offload.connector import KVConnector
from fornax.engine.lora.slots import LoRASlotTable
from fornax.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from fornax.engine.request import Request, RequestRejected, RequestStatus


class WaitingQueue:
    """Requests waiting for (re)admission, in the order the policy serves them.

    fcfs: a deque; a preempted request goes back to the front, ahead of newer arrivals.
    priority: a heap on (priority, arrival_order); a preempted request is simply pushed
    back, and its old arrival_order puts it ahead of later requests of equal priority.
    """

    def __init__(self, policy: str) -> None:
        self._fcfs = policy == "fcfs"
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []

    def __len__(self) -> int:
        return len(self._deque) if self._fcfs else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In no guaranteed order for the priority policy."""
        return iter(self._deque) if self._fcfs else (entry[2] for entry in self._heap)

    def push(self, request: Request) -> None:
        if self._fcfs:
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, (request.priority, request.arrival_order, request))

    def push_front(self, request: Request) -> None:
        if self._fcfs:
            self._deque.appendleft(request)
        else:
            self.push(request)

    def peek(self) -> Request:
        return self._deque[0] if self._fcfs else self._heap[0][2]

    def pop(self) -> Request:
        return self._deque.popleft() if self._fcfs else heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        """O(n): only aborts use it."""
        if self._fcfs:
            self._deque.remove(request)
        else:
            self._heap = [e for e in self._heap if e[2] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        connector: KVConnector | None = None,
        swap: bool = False,
        lora_slots: LoRASlotTable | None = None,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        # KV tiers below the primary pool, and whether a preemption swaps to them (else recomputes).
        self.connector = connector
        self.swap = swap and connector is not None
        if connector is not None:
            self.kv.record_evictions()
            connector.bind_block_hashes(self.kv.block_hash)
        # LoRA slots (engine/lora/): a request is admitted once its adapter holds one.
        self.lora_slots = lora_slots
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []  # in admission order; FCFS preempts from the end
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._next_arrival = 0
        # Ids freed as finished or aborted since the last schedule(): the runner drops their state.
        self._finished_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.spec_num_draft_tokens_total = 0  # drafts verified, over the engine's life
        self.spec_num_accepted_tokens_total = 0

    # -- queries --
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # -- admission and removal --
    def add_request(self, request: Request) -> None:
        """Queue a new request; raises RequestRejected if it could never run."""
        n_prompt = request.num_prompt_tokens
        max_len = self.config.max_model_len
        pooling = request.pooling_params is not None  # prefill only: no room for a generated token
        if n_prompt > max_len or (n_prompt == max_len and not pooling):
            room = (
                "; cut the input to fit (truncate_prompt_tokens)"
                if pooling
                else ", which must also leave room for at least one generated token"
            )
            raise RequestRejected(
                f"the prompt has {n_prompt} tokens, but the maximum context length is {max_len} tokens{room}"
            )
        budget = self.config.max_num_batched_tokens
        if request.whole_prompt and n_prompt > budget:
            raise RequestRejected(
                f"the prompt has {n_prompt} tokens, but this encoder model computes a prompt whole in "
                f"one step of at most {budget} tokens (--max-num-batched-tokens)"
            )
        capacity = self.kv.num_blocks * self.block_size
        if cdiv(n_prompt + (not pooling), self.block_size) > self.kv.num_blocks:
            raise RequestRejected(
                f"the prompt has {n_prompt} tokens, but the KV cache holds only {capacity} tokens "
                f"({self.kv.num_blocks} blocks of {self.block_size})"
            )
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        # Cap the output so the request fits both the context and, alone, the whole cache
        # (the last sampled token never needs a slot). Without the second cap, a request
        # could outgrow the cache, preempt itself, and wait forever for room that cannot exist.
        request.max_tokens = min(request.max_tokens, max_len - n_prompt, capacity - n_prompt + 1)
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish an unfinished request from outside (stop string, abort); False if unknown."""
        assert status.is_finished, f"{status.name} is not a finished status"
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._free(request)
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _free(self, request: Request) -> None:
        """The one path that releases a request's KV blocks (finish, abort, preemption).

        The caller has already taken the request out of `running`/`waiting` and set its status.
        """
        if self.connector is not None and request.is_finished:
            self.connector.request_finished(request, self.kv.cached_blocks(request))
        self.kv.free(request)
        if request.lora_slot is not None:  # running requests pin their adapter's slot
            assert self.lora_slots is not None
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = None
        if request.is_finished:
            request.times.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
            self._finished_ids.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Free a running request and queue it to recompute prompt + outputs from scratch, or,
        in swap mode, to load its computed blocks back from the host tier."""
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        if self.swap and request.num_computed_tokens > 0 and not request.reads_every_position:
            assert self.connector is not None
            n = request.num_computed_tokens
            table = self.kv.get_block_ids(request.request_id)[: cdiv(n, self.block_size)]
            self.connector.swap_out(request, table, n)  # no room: it recomputes instead
        self._free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push_front(request)

    def _pick_victim(self) -> Request:
        """The lowest-priority running request: FCFS the newest; 'priority' the largest value, then newest."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_order))
        return self.running[-1]

    # -- the step --
    def _chunk(self, num_tokens: int, budget: int) -> int:
        """How many of `num_tokens` pending tokens one request computes this step."""
        n = min(num_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first (in order), then admissions.

        Never more than max_num_batched_tokens tokens or max_num_seqs running requests,
        and never a zero-token entry. Changes statuses and block tables, not token counts.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}  # insertion order == batch order
        preempted: set[str] = set()
        budget = self._schedule_running(budget, scheduled, preempted)
        # After a preemption the cache is under pressure: admitting new work would only
        # evict it again. vLLM makes the same call.
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        finished, self._finished_ids = self._finished_ids, set()
        batch = list(scheduled.values())
        transfers = None
        if self.connector is not None:
            # After every lookup has pinned what it loads: saving evicted blocks may evict tier 1.
            self.connector.on_blocks_evicted(self.kv.take_evicted())
            transfers = self.connector.build_connector_meta()
        return SchedulerOutput(
            lora_writes=self.lora_slots.take_writes() if self.lora_slots is not None else [],
            scheduled=batch,
            num_batched_tokens=sum(s.num_new_tokens for s in batch),
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            kv_transfers=transfers,
        )

    def _schedule_running(
        self, budget: int, scheduled: dict[str, ScheduledRequest], preempted: set[str]
    ) -> int:
        """Give each running request its next tokens, preempting when blocks run out."""
        for request in list(self.running):  # a copy: preemption edits self.running
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            num_pending = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk(num_pending, budget)
            if num_new <= 0:
                continue  # nothing pending; cannot happen while every step samples
            spec = self._take_drafts(request, num_new, budget)
            block_ids = self.kv.allocate_slots(request, num_new + len(spec))
            if block_ids is None and spec:
                spec = []  # drafts are optional: drop them before preempting anyone for room
                block_ids = self.kv.allocate_slots(request, num_new)
            num_new += len(spec)
            while block_ids is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:
                    # 'priority' may pick one already given tokens this step: take them back.
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break  # it was the lowest-priority one left: it waits, the rest go on
                block_ids = self.kv.allocate_slots(request, num_new)
            if block_ids is None:
                # FCFS only picks itself when it is last in running order, so nothing is left;
                # under 'priority' the rest outrank it and are still served this step.
                continue
            scheduled[request.request_id] = ScheduledRequest(request, num_new, block_ids, spec)
            budget -= num_new
        return budget

    def _take_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's draft tokens that fit this step (clearing them on the request).

        Drafts only ride on a decode (the one pending token is the last known one), never
        take budget another request's token needs, and never run past max_tokens: with all
        of them accepted plus the target's own token, the request ends exactly at its limit.
        """
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        return spec[: max(room, 0)]

    def _schedule_waiting(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> None:
        """Admit waiting requests in policy order while budget, seats and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.lora is not None:  # its adapter needs a slot first; else it waits for one
                assert self.lora_slots is not None
                request.lora_slot = self.lora_slots.acquire(request.lora)
                if request.lora_slot is None:
                    break
            hit_blocks, num_hit, num_external = self._lookup(request)
            num_pending = request.num_tokens - num_hit - num_external
            if request.whole_prompt:  # an encoder's prompt goes whole, or waits for a step with room
                if num_pending > budget:
                    break
                num_new = num_pending
            else:
                num_new = self._chunk(num_pending, budget)
            # Tokens a tier supplies need blocks like computed ones, but no budget.
            block_ids = self.kv.allocate_slots(request, num_external + num_new, hit_blocks, num_hit)
            if self.connector is not None and num_external:
                num_external = self.connector.update_state_after_alloc(
                    request, block_ids, num_hit, num_external
                )
            if block_ids is None:
                if request.lora_slot is not None:
                    self.lora_slots.release(request.lora_slot)
                    request.lora_slot = None
                break  # never preempt running work to admit new work; wait for room
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # the first admission only, not a resume
                request.num_cached_tokens = num_hit + num_external
            # The hit is computed already: start after it. A tier load shorter than its lookup
            # (a damaged disk chunk) leaves blocks allocated ahead; later steps fill them.
            request.num_computed_tokens = num_hit + num_external
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            self.running.append(request)
            scheduled[request.request_id] = ScheduledRequest(request, num_new, block_ids)
            budget -= num_new

    def _lookup(self, request: Request) -> tuple[list[int], int, int]:
        """(primary hit blocks, their tokens, tokens the tiers add after them) for an admission.

        A swapped-out request takes all its computed tokens back from its swap slots instead; a
        pooling request that reads every position takes nothing (Request.reads_every_position).
        """
        if request.reads_every_position:
            return [], 0, 0
        if self.connector is not None:
            swapped = self.connector.num_swapped_tokens(request)
            if swapped:
                return [], 0, swapped
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        if self.connector is None:
            return hit_blocks, num_hit, 0
        return hit_blocks, num_hit, self.connector.get_num_new_matched_tokens(request, num_hit)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance computed counts, cache full blocks, append sampled tokens, finish on stop.
        A pooling request finishes when its prompt is computed (its vector is in the runner's output).

        Returns the requests that got a new token (finished ones included) or finished pooling.
        """
        changed: list[Request] = []
        finished: list[Request] = []
        now = time.monotonic()
        for sched in scheduler_output.scheduled:
            request = sched.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted or finished between schedule() and now
            start = request.num_computed_tokens
            tokens = runner_output.spec_sampled.get(request.request_id)
            verified = tokens is not None
            if tokens is None:
                request.num_computed_tokens += sched.num_new_tokens
                self.kv.cache_blocks(request, request.num_computed_tokens)
                if request.pooling_params is not None:
                    if request.num_computed_tokens >= request.num_prompt_tokens:  # its vector is out
                        request.embedding = runner_output.pooled[request.request_id]
                        request.times.first_token = request.times.last_token = now
                        request.status = RequestStatus.FINISHED_STOPPED
                        finished.append(request)
                        changed.append(request)
                    continue
                token = runner_output.sampled.get(request.request_id)
                if token is None:
                    continue  # a prefill chunk short of the prompt's end samples nothing
                tokens = [token]
            stopped = self._append_tokens(request, tokens, now)
            if verified:
                self._settle_drafts(request, sched, start, len(tokens) - 1, stopped)
            if stopped:
                finished.append(request)
            changed.append(request)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self._free(request)
        return changed

    @staticmethod
    def _append_tokens(request: Request, tokens: list[int], now: float) -> bool:
        """Append new tokens one by one, stopping at the first that finishes the request.

        Tokens after it are dropped, exactly as if they had never been generated: a run of
        accepted drafts that crosses max_tokens or a stop token is cut there.
        """
        if request.times.first_token is None:
            request.times.first_token = now
        request.times.last_token = now
        for token in tokens:
            request.append_output_token(token)
            if request.check_stop_on_token():  # sets the finished status
                return True
        return False

    def _settle_drafts(
        self, request: Request, sched: ScheduledRequest, start: int, num_accepted: int, finished: bool
    ) -> None:
        """After a verification: count the drafts, roll back rejected ones, release their blocks.

        Positions start .. start + num_accepted hold the last known token and the accepted
        drafts, all verified; the K/V written at rejected positions is stale and the blocks
        that only held those go back to the pool. Hashes cover accepted tokens only, since
        drafts never enter all_token_ids.
        """
        request.spec.num_steps += 1
        request.spec.num_draft_tokens += len(sched.spec_token_ids)
        request.spec.num_accepted_tokens += num_accepted
        self.spec_num_draft_tokens_total += len(sched.spec_token_ids)
        self.spec_num_accepted_tokens_total += num_accepted
        # The last appended token is never computed yet; a cut run appended fewer tokens.
        request.num_computed_tokens = min(start + 1 + num_accepted, request.num_tokens - 1)
        if not finished:
            self.kv.trim(request, request.num_computed_tokens)
            self.kv.cache_blocks(request, request.num_computed_tokens)
