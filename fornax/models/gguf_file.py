"""A lean reader for the GGUF container: header metadata and tensor views.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every array element, which
for a tokenizer's ~100k vocab and merge strings costs about 2 s before any weight is
read, almost half of our 5 s load budget. The container itself is simple (header,
key/values, tensor table, aligned data), so we parse it with `struct` and keep using the
`gguf` package for what it does well: the type constants and the dequantizers. Values come
out exactly as `GGUFReader.fields[k].contents()` gives them (Python scalars, lists), since
both the loader and the tokenizer read this one parse. Files are little-endian, except the
rare big-endian ones llama.cpp writes for s390x, which it flags by nothing but their byte order.
"""

from __future__ import annotations

import functools
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
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip


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

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
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
        return self.take(self.unpack("Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALARS:  # numeric arrays in one read
                dtype = np.dtype(self.order + _SCALARS[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            if item_type == GGUFValueType.STRING:  # vocab and merges: the hot loop
                return [self.string() for _ in range(count)]
            return [self.value(item_type) for _ in range(count)]
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
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFFormatError("implausible tensor or key count (corrupt header)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
            qtype, offset = cur.unpack("I"), cur.unpack("Q")
            infos.append((name, dims, qtype, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _tensor(self, data_start: int, name: str, dims: list[int], qtype_id: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown ggml type id {qtype_id}") from None
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        if dims[0] % block_elems:
            raise GGUFFormatError(f"tensor {name}: row of {dims[0]} is not a multiple of the {qtype.name} block")
        n_bytes = n_elems // block_elems * block_bytes
        start = data_start + offset
        if start + n_bytes > len(self._map):
            raise GGUFFormatError(f"truncated: tensor {name} ends past the end of the file")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start)
        shape = tuple(reversed(dims))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            code = "f4" if qtype == GGMLQuantizationType.F32 else "f2"
            raw = raw.view(np.dtype(self.byte_order + code)).reshape(shape)
        else:  # quantized/bf16: rows of packed blocks, as gguf.quants.dequantize expects
            raw = raw.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)
        return GGUFTensor(name=name, shape=shape, qtype=qtype, data=raw)
