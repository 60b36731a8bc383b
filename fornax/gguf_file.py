"""A lean reader for the GGUF container: header metadata and tensor views.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every array element, which
for a tokenizer's ~100k vocab and merge strings costs about 2 s before any weight is
read, almost half of our 5 s load budget. The container itself is simple (header,
key/values, tensor table, aligned data), so we parse it with `struct` and keep using the
`gguf` package for what it does well: the type constants (and its dequantizers as the
reference that layers/dequantize.py matches). Values come
out exactly as `GGUFReader.fields[k].contents()` gives them (Python scalars, lists), since
both the loader and the tokenizer read this one parse. Files are little-endian, except the
rare big-endian ones llama.cpp writes for s390x, which it flags by nothing but their byte order.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
# struct format characters, without a byte order; numpy reads the same codes (with "<"/">"
# in front, their sizes are the standard ones: I is 4 bytes, Q is 8).
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# Limits on what the header may claim, checked before anything is read or sized from it, so a
# hostile file fails with a clear message instead of a huge allocation, a deep recursion or a
# long loop. Counts are also bounded by the bytes left in the file (each item takes at least
# a few bytes), which is what stops a length field of 2**63 before it is used.
MAX_TENSORS = MAX_KV = 1_000_000  # real files hold a few thousand of either
MAX_DIMS = 4  # ggml tensors have at most four dimensions
MAX_ARRAY_DEPTH = 2  # an array of arrays; nothing deeper is written, and the bound stops a
# chain of nested arrays (12 bytes a level) from exhausting Python's stack
INT64_MAX = (1 << 63) - 1  # ggml counts elements in int64
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # an empty array: item type, count
_MIN_STRING_BYTES = 8  # an empty string: its length


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF (bad magic, version, truncated, ...)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: reversed ggml ne[]
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8) or the typed array for float types, zero-copy from the map

    @property
    def type_name(self) -> str:
        return self.qtype.name


@functools.cache
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


class _Cursor:
    """Reads the header in place: unpack_from and slices of the map, no intermediate views
    (the ~100k vocab and merge strings make this loop the whole cost of opening a file)."""

    def __init__(self, buf: mmap.mmap, order: str = "<") -> None:
        self.buf, self.pos, self.order = buf, 0, order  # order: "<" little- or ">" big-endian

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> bytes:
        if n > self.remaining:
            raise GGUFFormatError("file ends inside the header (truncated?)")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def unpack(self, fmt: str) -> Any:
        st = _struct(self.order + fmt)
        if self.pos + st.size > len(self.buf):
            raise GGUFFormatError("file ends inside the header (truncated?)")
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n  # inline, not take(): this runs once per vocab and merge string
        if end > len(self.buf):
            raise GGUFFormatError(f"string length {n} runs past the end of the file (truncated?)")
        self.pos = end
        return self.buf[end - n : end].decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        raise GGUFFormatError(f"unknown metadata value type {vtype}")

    def array(self, depth: int) -> list[Any]:
        item_type, count = self.unpack("I"), self.unpack("Q")
        if item_type == GGUFValueType.ARRAY and depth >= MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        # Every item takes at least this many bytes: a count the file cannot hold is refused
        # before the loop below starts building its list.
        if count * _min_value_bytes(item_type) > self.remaining:
            raise GGUFFormatError(f"array of {count} items runs past the end of the file (truncated?)")
        if item_type in _SCALARS:  # numeric arrays in one read
            dtype = np.dtype(self.order + _SCALARS[item_type])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if item_type == GGUFValueType.STRING:  # vocab and merges: the hot loop
            return [self.string() for _ in range(count)]
        return [self.value(item_type, depth) for _ in range(count)]


def _min_value_bytes(vtype: int) -> int:
    if vtype in _SCALARS:
        return _struct("<" + _SCALARS[vtype]).size
    if vtype == GGUFValueType.STRING:
        return _MIN_STRING_BYTES
    if vtype == GGUFValueType.ARRAY:
        return _MIN_ARRAY_BYTES
    raise GGUFFormatError(f"unknown metadata value type {vtype}")


class GGUFFile:
    """Parsed header of a GGUF file; tensor data stays memory-mapped until used."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # empty file
                raise GGUFFormatError("file is empty") from None
        cur = _Cursor(self._map)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFFormatError("bad magic (not a GGUF file)")
        self.version = cur.unpack("I")
        if self.version and not self.version & 0xFFFF:  # a small version number, byte-swapped
            cur.order, self.version = ">", int.from_bytes(self.version.to_bytes(4, "little"), "big")
        self.byte_order = cur.order
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise GGUFFormatError(f"implausible tensor or key count ({n_tensors}, {n_kv}; corrupt header)")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > cur.remaining:
            raise GGUFFormatError(f"{n_kv} keys and {n_tensors} tensors cannot fit in the file (truncated?)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            try:
                self.metadata[key] = cur.value(cur.unpack("I"))
            except GGUFFormatError as exc:  # say where: the key is the only landmark a reader has
                raise GGUFFormatError(f"metadata {key[:64]!r}: {exc}") from None
        infos = [_tensor_info(cur) for _ in range(n_tensors)]
        _check_unique_names([name for name, *_ in infos])
        alignment = _alignment(self.metadata)
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, alignment, *info) for info in infos]

    def drop_resident_pages(self) -> None:
        """Unmap the pages read so far from this process (they stay in the page cache): after
        loading copied what it needs, the file's bytes would otherwise count in the process's
        resident set for as long as the map lives (the embedding rows keep it, layers/embedding.py).
        A later read faults its pages back in."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _tensor(
        self, data_start: int, alignment: int, name: str, dims: list[int], qtype_id: int, offset: int
    ) -> GGUFTensor:
        label = repr(name[:64])  # a corrupt name may hold newlines, or be megabytes long
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {label} has unknown ggml type id {qtype_id}") from None
        if offset % alignment:  # writers always align data; an aligned start keeps typed views aligned
            raise GGUFFormatError(f"tensor {label}: data offset {offset} is not a multiple of {alignment}")
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elems = math.prod(dims)  # exact: _tensor_info bounded it to int64
        if dims[0] % block_elems:
            raise GGUFFormatError(
                f"tensor {label}: row of {dims[0]} is not a whole number of {qtype.name} blocks"
            )
        n_bytes = n_elems // block_elems * block_bytes
        start = data_start + offset
        if start + n_bytes > len(self._map):
            raise GGUFFormatError(f"truncated: tensor {label} ends past the end of the file")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start)
        shape = tuple(reversed(dims))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            code = "f4" if qtype == GGMLQuantizationType.F32 else "f2"
            raw = raw.view(np.dtype(self.byte_order + code)).reshape(shape)
        else:  # quantized/bf16: rows of packed blocks, as the dequantizers expect
            raw = raw.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)
        return GGUFTensor(name=name, shape=shape, qtype=qtype, data=raw)


def _tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
    """One tensor-table entry, its shape checked before anything is sized from it."""
    name = cur.string()
    n_dims = cur.unpack("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor {name[:64]!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = [cur.unpack("Q") for _ in range(n_dims)]
    if 0 in dims:
        raise GGUFFormatError(f"tensor {name[:64]!r} has an empty dimension {dims}")
    if math.prod(dims) > INT64_MAX:
        raise GGUFFormatError(f"tensor {name[:64]!r}: element count of {dims} overflows int64")
    qtype, offset = cur.unpack("I"), cur.unpack("Q")
    return name, dims, qtype, offset


def _check_unique_names(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:  # the loader keys tensors by name: a later one would silently win
            raise GGUFFormatError(f"tensor {name[:64]!r} appears twice")
        seen.add(name)


def _alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", 32)  # the GGUF default
    is_int = isinstance(alignment, int) and not isinstance(alignment, bool)  # bool is an int subclass
    if not is_int or alignment <= 0 or alignment & (alignment - 1):  # 0 would divide by zero below
        raise GGUFFormatError(f"general.alignment must be a power of two above 0, got {alignment!r:.60}")
    return alignment
