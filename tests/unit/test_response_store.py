"""The Responses API store (server/response_store.py): tenants apart, bounded, fair eviction,
and conversations that survive their earlier turns' eviction."""

from __future__ import annotations

from fornax.server.response_store import ResponseStore, StoredResponse


def _stored(n: int, previous: StoredResponse | None = None) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"turn": n}], previous)


def test_a_key_never_reads_or_deletes_another_keys_response() -> None:
    store = ResponseStore(10)
    store.put("alice", "resp_1", _stored(1))
    assert store.get("alice", "resp_1") is not None
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None and len(store) == 0


def test_when_full_the_key_holding_most_loses_its_least_recently_used() -> None:
    store = ResponseStore(4)
    store.put("bob", "b1", _stored(1))
    for n in range(2, 5):
        store.put("alice", f"a{n}", _stored(n))
    store.get("alice", "a2")  # used: a3 is now alice's least recently used
    store.put("alice", "a5", _stored(5))
    assert len(store) == 4 and store.get("bob", "b1") is not None
    assert store.get("alice", "a3") is None and store.get("alice", "a2") is not None
    none_kept = ResponseStore(0)
    none_kept.put("alice", "x", _stored(0))
    assert len(none_kept) == 0 and none_kept.get("alice", "x") is None


def test_a_conversation_outlives_the_eviction_of_its_earlier_turns() -> None:
    store = ResponseStore(1)
    first = _stored(1)
    store.put("alice", "resp_1", first)
    second = _stored(2, previous=first)
    store.put("alice", "resp_2", second)  # evicts resp_1
    assert store.get("alice", "resp_1") is None
    assert store.get("alice", "resp_2").conversation() == [{"turn": 1}, {"turn": 2}]
