"""The responses `POST /v1/responses` keeps (`store: true`, the default), so that `GET` and
`DELETE /v1/responses/{id}` find them and `previous_response_id` continues their conversation.

Kept in memory, per tenant: a response belongs to the API key name that created it, and another
key asking for it is told it does not exist, exactly as for an id never issued, so ids reveal
nothing across tenants (the tenancy rule of docs/usage.md, "OpenAI Responses API").

Bounded by `--max-stored-responses` in all. When full, the least recently used response of the
key holding the most goes: one tenant storing many pushes out its own old responses before any
other key's, so it cannot empty the store of everyone else's.

Each stored response holds only its own items (its input and its output) and a reference to the
response it continued; the whole conversation is read by walking back. A chain of turns so shares
its earlier turns instead of copying them into every response, and a continued response still
reads its earlier turns after they were evicted or deleted (it holds them). What one chain keeps
alive is what its last prompt held, which the model's context bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class StoredResponse:
    """One kept response: its object as GET returns it, and its turn of the conversation."""

    body: dict[str, Any]  # the response object, as it was returned
    items: list[dict[str, Any]]  # this turn's input items, then its output items
    previous: StoredResponse | None  # the response this one continued

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response, oldest first."""
        turns: list[list[dict[str, Any]]] = []
        at: StoredResponse | None = self
        while at is not None:  # iterative: a long chain must not hit the recursion limit
            turns.append(at.items)
            at = at.previous
        return [item for turn in reversed(turns) for item in turn]


class ResponseStore:
    """Responses by tenant (API key name) and id, least recently used first; event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_key: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def get(self, key: str, response_id: str) -> StoredResponse | None:
        """The key's response with this id (now its most recently used), or None."""
        responses = self._by_key.get(key)
        if responses is None or response_id not in responses:
            return None
        responses.move_to_end(response_id)
        return responses[response_id]

    def put(self, key: str, response_id: str, stored: StoredResponse) -> None:
        if self.capacity < 1:
            return
        responses = self._by_key.setdefault(key, OrderedDict())
        if response_id not in responses:
            self._size += 1
        responses[response_id] = stored
        responses.move_to_end(response_id)
        while self._size > self.capacity:
            self._evict()

    def delete(self, key: str, response_id: str) -> bool:
        responses = self._by_key.get(key)
        if responses is None or responses.pop(response_id, None) is None:
            return False
        self._size -= 1
        if not responses:
            del self._by_key[key]
        return True

    def _evict(self) -> None:
        """The least recently used response of the key that holds the most."""
        key = max(self._by_key, key=lambda k: len(self._by_key[k]))
        responses = self._by_key[key]
        responses.popitem(last=False)
        self._size -= 1
        if not responses:
            del self._by_key[key]
