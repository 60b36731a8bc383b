"""Tier bookkeeping and the disk format, without a model."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from fornax.engine.kv.offload.disk_store import HEADER_SIZE, DiskStore, model_identity
from fornax.engine.kv.offload.host_index import HostIndex
from fornax.engine.kv.offload.host_pool import BlockLayout, HostPool
from fornax.layers.kv_pool import LayerKV


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


# -- host index --
def test_host_index_evicts_least_recently_used_and_never_a_pinned_slot() -> None:
    index = HostIndex(3)
    slots = [index.insert(h(i)) for i in range(3)]
    assert sorted(slots) == [0, 1, 2]
    index.lookup(h(0))  # now the most recently used
    index.pin(slots[1])
    new = index.insert(h(3))  # evicts h(2): h(1) is pinned, h(0) was just used
    assert new == slots[2] and h(2) not in index and h(1) in index and h(0) in index
    index.check_integrity()
    index.pin(slots[0])
    index.pin(new)
    assert index.insert(h(4)) is None  # every slot pinned: nothing is evicted
    index.unpin(slots[1])
    assert index.insert(h(4)) == slots[1]
    index.check_integrity()


def test_swap_out_is_all_or_nothing_and_never_evicted() -> None:
    index = HostIndex(4)
    index.insert(h(0))
    swapped = index.swap_out("a", 3, 40)  # 3 free slots
    assert swapped is not None
    assert index.swap_out("b", 2, 20) is None  # 1 cached slot to evict is not enough
    assert h(0) in index, "a failed swap-out must not evict anything"
    assert index.swapped("a") == (swapped, 40)
    assert index.insert(h(1)) not in swapped  # evicts h(0), never a swapped slot
    assert index.insert(h(2)) not in swapped and h(1) not in index
    assert index.swapped("a") == (swapped, 40)
    index.release_swap("a")
    assert index.swapped("a") is None and index.num_used == 1
    index.check_integrity()


# -- host pool copies --
@pytest.mark.parametrize(("primary", "form"), [("auto", False), ("auto", True), ("int8", True)])
def test_save_then_load_restores_blocks(primary: str, form: bool) -> None:
    torch.manual_seed(0)
    bs, hkv, d, layers_n, blocks = 4, 2, 8, 3, 6
    layers = [LayerKV.allocate(blocks * bs, hkv, d, torch.float32, primary) for _ in range(layers_n)]
    for layer in layers:
        layer.write(
            torch.arange(blocks * bs), torch.randn(blocks * bs, hkv, d), torch.randn(blocks * bs, hkv, d)
        )
    before = [layer.gather(torch.arange(blocks * bs), torch.float32) for layer in layers]
    layout = BlockLayout(layers_n, bs, hkv, d, torch.float32, form)
    pool = HostPool(layout, 4)
    pool.save(layers, [1, 4], [3, 0])
    payload = bytes(pool.view(3))
    assert len(payload) == layout.block_bytes
    for layer in layers:  # wipe blocks 1 and 4, then bring them back (one from disk bytes)
        layer.write(torch.arange(bs, 2 * bs), torch.zeros(bs, hkv, d), torch.zeros(bs, hkv, d))
        layer.write(torch.arange(4 * bs, 5 * bs), torch.zeros(bs, hkv, d), torch.zeros(bs, hkv, d))
    pool.load_payloads(layers, [payload], [1])
    pool.load(layers, [0], [4])
    tol = 0.0 if (primary == "int8" or not form) else 0.02  # int8 form of fp32 rows: rounding
    for layer, (k0, v0) in zip(layers, before):
        k1, v1 = layer.gather(torch.arange(blocks * bs), torch.float32)
        torch.testing.assert_close(k1, k0, atol=tol * k0.abs().max().item(), rtol=0)
        torch.testing.assert_close(v1, v0, atol=tol * v0.abs().max().item(), rtol=0)


# -- disk store --
def _store(tmp_path, identity=b"\1" * 32, capacity=10_000, payload=100) -> DiskStore:
    return DiskStore(tmp_path, identity, capacity, payload)


def test_disk_round_trip_survives_a_new_store(tmp_path) -> None:
    store = _store(tmp_path)
    assert store.write_async(h(1), b"x" * 100)
    assert not store.write_async(h(1), b"x" * 100), "a block is written once"
    assert store.flush()
    again = _store(tmp_path)  # a restart: the index is rebuilt from the files
    assert h(1) in again and again.read(h(1)) == b"x" * 100
    assert again.read(h(2)) is None


def test_a_damaged_or_truncated_chunk_is_never_loaded(tmp_path) -> None:
    store = _store(tmp_path)
    for i in range(3):
        store.write_async(h(i), bytes([i]) * 100)
    store.flush()
    flipped, truncated = store._path(h(0)), store._path(h(1))
    data = bytearray(flipped.read_bytes())
    data[HEADER_SIZE + 7] ^= 0x40
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    fresh = _store(tmp_path)  # the truncated file is dropped by size at the scan
    assert fresh.read(h(0)) is None and fresh.read(h(1)) is None
    assert fresh.read(h(2)) == bytes([2]) * 100
    assert not flipped.exists() and not truncated.exists()
    assert fresh.num_corrupt == 1  # the flipped one failed its checksum at read time


def test_another_models_chunks_are_never_read(tmp_path) -> None:
    a = model_identity("weights-a", dtype="float32", block_size=16)
    b = model_identity("weights-b", dtype="float32", block_size=16)
    assert a != b and model_identity("weights-a", dtype="bfloat16", block_size=16) != a
    store_a = _store(tmp_path, identity=a)
    store_a.write_async(h(1), b"a" * 100)
    store_a.flush()
    store_b = _store(tmp_path, identity=b)
    assert h(1) not in store_b and store_b.read(h(1)) is None
    # A file moved into the other model's directory is refused by its header.
    target = store_b._path(h(1))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(store_a._path(h(1)), target)
    assert _store(tmp_path, identity=b).read(h(1)) is None


def test_disk_bound_is_respected_least_recently_used_first(tmp_path) -> None:
    file_size = HEADER_SIZE + 100
    store = _store(tmp_path, capacity=3 * file_size)
    for i in range(3):
        store.write_async(h(i), bytes([i]) * 100)
        store.flush()
        assert store.take_finished() == [h(i)]  # the engine learns of writes here
    assert store.read(h(0)) is not None  # h(0) used: h(1) is now the oldest
    for i in (3, 4):
        store.write_async(h(i), bytes([i]) * 100)  # makes room first: stored + queued <= bound
        store.flush()
        store.take_finished()
    on_disk = sorted(p.name for p in store.dir.rglob("*.kv"))
    assert len(on_disk) == 3 and store.bytes_used <= 3 * file_size
    assert h(1) not in store and h(2) not in store and h(0) in store
    smaller = _store(tmp_path, capacity=2 * file_size)  # a restart with a smaller bound
    assert len(list(smaller.dir.rglob("*.kv"))) == 2
