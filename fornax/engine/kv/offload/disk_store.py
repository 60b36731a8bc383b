"""Tier 2: KV blocks as files on disk, content-addressed, checksummed, LRU-bounded.

A file holds one block in tier 1's byte form (host_pool.py). Its name is the block's chained
prefix-cache hash (engine/kv/block_pool.py: the hash covers the block's tokens and every token
before it, and the cache salt); its directory is named by the model's identity: a digest of the
weights file(s), the dtype, the KV form and the block size (`model_identity`). A different model,
or the same one in another dtype or block size, looks in another directory, and every file
repeats the identity in its header, so a moved file is refused too.

    header: MAGIC (8) | identity (32) | block hash (32) | payload length (8, little endian)
            | XXH3-128 of the payload (16) | zeros (16)
    payload: the block's bytes

A file that is short, has a wrong header or fails its checksum is deleted and reported as a
miss: the block is recomputed, never loaded. Writes go to a temporary name and are renamed into
place, so a reader (or a restart after a crash) sees a whole file or none; they run on a
background thread, off the engine's critical path. Past `capacity` bytes the least recently
used files are deleted; use is the file's mtime, so LRU order survives a restart.

Threads: the index (which blocks are stored, in LRU order; which are being written) belongs to
the engine thread alone, with no lock. The writer thread only carries out file operations sent
to it through a queue and reports each write's end through a deque, which the engine thread
reads in `take_finished`. (No lock also means no priority inversion: the engine never waits
for the writer to be scheduled.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path

import xxhash

from fornax.engine.kv.block_pool import BlockHash

logger = logging.getLogger("fornax.kv.disk")

MAGIC = b"FXKV\x00\x02\x00\x00"  # format 2: XXH3-128 checksums
HEADER_SIZE = len(MAGIC) + 32 + 32 + 8 + 32
SUFFIX = ".kv"


def _checksum(payload: bytes | memoryview) -> bytes:
    """32 bytes: XXH3-128, padded. It catches accidental damage (bit flips, torn or truncated
    writes); no cryptographic digest is needed, since the block hash in the name and the header
    already says which prefix a file claims to hold. Fast: every persisted block is summed."""
    return xxhash.xxh3_128_digest(payload) + bytes(16)


def file_digest(paths: Iterable[Path], cache_file: Path | None = None) -> str:
    """sha256 over the files' bytes (in the given order), memoized in `cache_file` by path,
    size and mtime, so a restart does not re-read a large model."""
    paths = [Path(p).resolve() for p in paths]
    key = json.dumps([(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths])
    memo: dict[str, str] = {}
    if cache_file is not None and cache_file.exists():
        try:
            memo = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    if cache_file is not None:
        memo[key] = value
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps(memo))
        except OSError:
            pass  # only a memo
    return value


def model_identity(weights_digest: str, **form: object) -> bytes:
    """32 bytes naming everything a stored block's bytes depend on."""
    text = json.dumps({"weights": weights_digest, **form}, sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


class DiskStore:
    def __init__(self, root: str | Path, identity: bytes, capacity: int, payload_size: int) -> None:
        assert len(identity) == 32
        self.identity, self.capacity, self.payload_size = identity, capacity, payload_size
        self.dir = Path(root).expanduser() / identity.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file_size = HEADER_SIZE + payload_size
        if self.file_size > capacity:
            raise ValueError(f"the disk tier's bound ({capacity} bytes) is smaller than one block's file")
        self._files: OrderedDict[BlockHash, None] = OrderedDict()  # stored, least recently used first
        self._pending: set[BlockHash] = set()  # queued or being written
        self.num_written = self.num_evicted = self.num_corrupt = self.num_write_errors = 0
        self.bytes_written = self.bytes_read = 0
        self._queue: queue.Queue[tuple[str, BlockHash, memoryview | None]] = queue.Queue()
        self._results: deque[tuple[BlockHash, bool]] = deque()  # (block, written?), from the writer
        self._scan()
        for i in range(256):  # every file's directory exists before the writer needs it
            (self.dir / f"{i:02x}").mkdir(exist_ok=True)
        self._writer = threading.Thread(target=self._write_loop, name="fornax-kv-disk", daemon=True)
        self._writer.start()

    # -- index (engine thread) --
    def _path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous run left, oldest use first; drop half-written temporaries."""
        found: list[tuple[float, BlockHash]] = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(SUFFIX):
                    Path(entry.path).unlink(missing_ok=True)  # a write cut off by a crash
                    continue
                try:
                    block_hash = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                if len(block_hash) == 32 and stat.st_size == self.file_size:
                    found.append((stat.st_mtime, block_hash))
                else:
                    Path(entry.path).unlink(missing_ok=True)
        found.sort()
        for _, block_hash in found:
            self._files[block_hash] = None
        while len(self._files) * self.file_size > self.capacity:  # a smaller bound than last time
            self._path(self._files.popitem(last=False)[0]).unlink(missing_ok=True)
            self.num_evicted += 1

    @property
    def num_files(self) -> int:
        return len(self._files)

    @property
    def bytes_used(self) -> int:
        return len(self._files) * self.file_size

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files or block_hash in self._pending

    # -- reads (engine thread) --
    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload, verified; None if absent or damaged (a damaged file is deleted)."""
        if block_hash not in self._files:
            return None
        self._files.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            with path.open("rb") as f:
                data = f.read(self.file_size + 1)
        except OSError:
            data = b""
        payload = self._verify(data, block_hash)
        if payload is None:
            logger.warning("KV disk tier: %s is damaged or truncated; ignored and deleted", path.name)
            del self._files[block_hash]
            self.num_corrupt += 1
            path.unlink(missing_ok=True)
            return None
        self.bytes_read += len(payload)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU clock that survives a restart
        return payload

    def _verify(self, data: bytes, block_hash: BlockHash) -> bytes | None:
        if len(data) != self.file_size:
            return None
        view = memoryview(data)
        m = len(MAGIC)
        if view[:m] != MAGIC or view[m : m + 32] != self.identity or view[m + 32 : m + 64] != block_hash:
            return None
        if int.from_bytes(view[m + 64 : m + 72], "little") != self.payload_size:
            return None
        payload = view[HEADER_SIZE:]
        if _checksum(payload) != view[m + 72 : m + 104]:
            return None
        return bytes(payload)

    # -- writes (queued by the engine thread, done by the writer thread) --
    def write_async(self, block_hash: BlockHash, payload: bytes | memoryview) -> bool:
        """Queue a block for writing; False if it is stored or queued already.

        The payload is read by the writer thread later, without a copy: the caller keeps its
        bytes unchanged until `take_finished` names the block (host slots stay pinned till then).
        Room is made first, so stored plus queued files never pass the bound.
        """
        payload = memoryview(payload)
        assert payload.nbytes == self.payload_size
        if block_hash in self._files or block_hash in self._pending:
            return False
        while (len(self._files) + len(self._pending) + 1) * self.file_size > self.capacity and self._files:
            evicted, _ = self._files.popitem(last=False)
            self._queue.put(("delete", evicted, None))
            self.num_evicted += 1
        if (len(self._pending) + 1) * self.file_size > self.capacity:
            return False  # the queue alone fills the bound: this block is not persisted
        self._pending.add(block_hash)
        self._queue.put(("write", block_hash, payload))
        return True

    def take_finished(self) -> list[BlockHash]:
        """Blocks whose write ended (stored, or failed and logged) since the last call."""
        done = []
        while self._results:
            block_hash, ok = self._results.popleft()
            self._pending.discard(block_hash)
            if ok:
                self._files[block_hash] = None
                self.num_written += 1
                self.bytes_written += self.payload_size
            else:
                self.num_write_errors += 1
            done.append(block_hash)
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued operation is done; False if `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- the writer thread --
    def _write_loop(self) -> None:
        while True:
            op, block_hash, payload = self._queue.get()
            try:
                if op == "write":
                    assert payload is not None
                    self._results.append((block_hash, self._write(block_hash, payload)))
                else:
                    self._path(block_hash).unlink(missing_ok=True)
            except Exception:
                logger.exception("KV disk tier: %s failed", op)
                if op == "write":
                    self._results.append((block_hash, False))
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, payload: memoryview) -> bool:
        """Header and payload in one writev under a temporary name, then renamed into place.

        Few system calls and little Python per block, on purpose: each time this thread comes
        back from a call it takes the GIL from the engine thread."""
        path = str(self._path(block_hash))
        header = (
            MAGIC + self.identity + block_hash + payload.nbytes.to_bytes(8, "little") + _checksum(payload)
        )
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = os.writev(fd, [header, payload])
                if written < len(header) + payload.nbytes:  # a short write: finish it plainly
                    rest = (header + bytes(payload))[written:]
                    while rest:
                        rest = rest[os.write(fd, rest) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            logger.warning("KV disk tier: writing %s failed: %s", path, exc)
            return False
        return True
