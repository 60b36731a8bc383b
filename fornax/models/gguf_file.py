"""A lean reader for the GGUF container: header metadata and tensor views.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every array element, which
for a tokenizer's ~100k vocab and merge strings costs about 2 s before any weight is
read, almost half of our 5 s load budget. The container itself is simple (little-endian
header, key/values, tensor table, aligned data), so we parse it with `struct` and keep
using the `gguf` package for what it does well: the type constants and the dequantizers.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_NUMPY: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
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


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("file ends inside the header (truncated?)")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _NUMPY:  # numeric arrays in one read
                dtype = np.dtype(_NUMPY[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
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
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFFormatError("bad magic (not a GGUF file)")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFFormatError("implausible tensor or key count (corrupt header)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            qtype, offset = cur.unpack("<I"), cur.unpack("<Q")
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
            raw = raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16).reshape(shape)
        else:  # quantized/bf16: rows of packed blocks, as gguf.quants.dequantize expects
            raw = raw.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)
        return GGUFTensor(name=name, shape=shape, qtype=qtype, data=raw)
