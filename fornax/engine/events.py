"""A small lifecycle-event bus: the engine thread publishes, asyncio subscribers read.

Why a bus and not more StepStats fields: a live view wants to follow one request through
its life (queued -> scheduled -> blocks -> prefill chunks -> tokens -> finished), while
metrics only want per-step totals. Building those per-request events is not free, so the
engine asks `bus.active` (one attribute read) before building any of them; with nobody
subscribed nothing else runs (benchmarks/event_overhead.py measures it).

Threading: `publish` runs in the engine thread and never blocks on a subscriber. Each
subscriber owns a bounded asyncio.Queue in its own event loop; a batch of events crosses
over with one `loop.call_soon_threadsafe` per subscriber per step. A subscriber that falls
behind loses its oldest events (and is told how many), the engine never waits for it.

History: while anyone is subscribed, the last events of the most recent requests are kept,
so a subscriber that learns a request id late (e.g. from the first streamed chunk) can
still replay the request from its `queued` event. Subscribing and publishing share one
lock, so a late subscriber sees every event exactly once: the history, then the live tail.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# Event types, in the order a request meets them. `preempted` sends it back to `queued`
# (its blocks are freed; it is `scheduled` again later). `spec_verify` comes with the tokens
# of a step that verified speculative drafts.
EVENT_TYPES = (
    "queued",
    "scheduled",
    "blocks",
    "prefill_chunk",
    "spec_verify",
    "token",
    "preempted",
    "finished",
)


@dataclass(slots=True)
class Event:
    """One thing that happened to one request. `data` holds the type's fields
    (docs/observability.md, "Events and live snapshots")."""

    type: str
    request_id: str  # the user's request id (the parent, when n > 1)
    time: float  # wall clock (time.time()), for display next to other clocks
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0  # bus-wide sequence number, set by publish: order and gap detection

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "request_id": self.request_id,
            "time": self.time,
            "seq": self.seq,
            **self.data,
        }


class Subscription:
    """One reader: a bounded queue in its event loop, optionally filtered to one request."""

    def __init__(
        self, bus: EventBus, loop: asyncio.AbstractEventLoop, request_id: str | None, maxsize: int
    ) -> None:
        self.bus, self.loop, self.request_id = bus, loop, request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=maxsize)
        self.dropped = 0  # events lost because this reader was slow
        self.closed = False

    def wants(self, event: Event) -> bool:
        return self.request_id is None or event.request_id == self.request_id

    def deliver(self, events: list[Event]) -> None:
        """In the subscriber's loop: enqueue, dropping the oldest events when full."""
        if self.closed:
            return
        for event in events:
            if self.queue.full():
                self.queue.get_nowait()
                self.dropped += 1
            self.queue.put_nowait(event)

    async def get(self) -> Event:
        return await self.queue.get()

    def close(self) -> None:
        self.closed = True
        self.bus.unsubscribe(self)


class EventBus:
    def __init__(self, history_requests: int = 64, history_events: int = 4096) -> None:
        # Read by the engine thread without the lock: a plain bool write/read is atomic.
        self.active = False
        # Bumped each time the bus goes from idle to active, so engine-side trackers know to
        # drop state they may have left half-updated while nobody was watching.
        self.generation = 0
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self._history: OrderedDict[str, list[Event]] = OrderedDict()
        self._history_requests, self._history_events = history_requests, history_events
        self._seq = 0
        self.num_published = 0

    # -- subscribers (event loop side) --
    def subscribe(
        self,
        request_id: str | None = None,
        *,
        replay: bool = True,
        maxsize: int = 2048,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Subscription:
        """A new reader; with `request_id` and `replay`, it first gets that request's history."""
        sub = Subscription(self, loop or asyncio.get_running_loop(), request_id, maxsize)
        with self._lock:
            if request_id is not None and replay:
                sub.deliver(list(self._history.get(request_id, ())))
            self._subs.append(sub)
            if not self.active:
                self.generation += 1
                self.active = True
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            self.active = bool(self._subs)
            if not self.active:
                self._history.clear()  # nobody can ask for it, and it would go stale

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    def history(self, request_id: str) -> list[Event]:
        with self._lock:
            return list(self._history.get(request_id, ()))

    # -- the engine side --
    def publish(self, events: list[Event]) -> None:
        """Record and fan out one step's events. Never blocks on a reader."""
        if not events:
            return
        with self._lock:
            for event in events:
                self._seq += 1
                event.seq = self._seq
                self._remember(event)
            self.num_published += len(events)
            targets = [(sub, [e for e in events if sub.wants(e)]) for sub in self._subs]
        for sub, batch in targets:
            if batch:
                try:
                    sub.loop.call_soon_threadsafe(sub.deliver, batch)
                except RuntimeError:  # its loop has closed: the reader is gone
                    self.unsubscribe(sub)

    def _remember(self, event: Event) -> None:
        past = self._history.get(event.request_id)
        if past is None:
            past = self._history[event.request_id] = []
            while len(self._history) > self._history_requests:
                self._history.popitem(last=False)
        if len(past) < self._history_events:
            past.append(event)
