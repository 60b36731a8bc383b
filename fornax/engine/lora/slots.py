"""The bookkeeping of LoRA adapters (docs/lora.md): which are registered, which sit in slots.

Two parts, each with one owner:
- `LoRARegistry` (the engine core): adapters by name, read and checked once (models/lora.py),
  held on the host. Registering and removing are safe while steps run: a request takes its
  adapter object when it is added, so removing a name turns new requests away and lets the
  running ones finish.
- `LoRASlotTable` (the scheduler): which adapter each of the `max_loras` slots holds and how
  many running requests pin it. A waiting request is admitted only once its adapter has a slot;
  a slot no running request pins is reused for another adapter, least recently used first.
  Pure bookkeeping (no torch): the writes it decides are carried out by the runner.
The runner writes the slots and tells the adapted Linears each row's slot (layers/lora.py
LoRAStep.build); serving.py ties these to a model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fornax.engine.request import RequestRejected

if TYPE_CHECKING:
    from fornax.models.lora import LoRAAdapter


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a prompt runs with (vLLM's shape): by name, loaded from `lora_path` first
    if the engine does not know the name yet. `lora_int_id` is accepted for vLLM's callers;
    names identify adapters here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


class LoRARegistry:
    """Adapters by name: what a request's `model` (or LoRARequest) may pick."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRAAdapter] = {}

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoRAAdapter | None:
        return self._by_name.get(name)

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self._by_name:
            raise RequestRejected(f"an adapter named {adapter.name!r} is already loaded; unload it first")
        self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> LoRAAdapter:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        return adapter


class LoRASlotTable:
    """Slot bookkeeping for the scheduler: occupants, pins, recency, and the writes pending."""

    def __init__(self, max_loras: int) -> None:
        self.occupant: list[LoRAAdapter | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self._writes: list[tuple[int, LoRAAdapter]] = []

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """A slot holding `adapter`, pinned once more; None when every slot is pinned by others."""
        for slot, held in enumerate(self.occupant):
            if held is adapter:
                self.pins[slot] += 1
                self._last_used[slot] = next(self._clock)
                return slot
        free = [s for s in range(len(self.pins)) if self.pins[s] == 0]
        if not free:
            return None
        # an empty slot first, then the one unused the longest
        slot = min(free, key=lambda s: (self.occupant[s] is not None, self._last_used[s]))
        self.occupant[slot] = adapter
        self.pins[slot] = 1
        self._last_used[slot] = next(self._clock)
        self._writes.append((slot, adapter))
        return slot

    def release(self, slot: int) -> None:
        assert self.pins[slot] > 0, f"slot {slot} released more often than acquired"
        self.pins[slot] -= 1

    def take_writes(self) -> list[tuple[int, LoRAAdapter]]:
        """The slot writes decided since the last call, for the runner to make before its step."""
        writes, self._writes = self._writes, []
        return writes
