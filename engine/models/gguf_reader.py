"""A minimal GGUF (v2/v3, little-endian) reader: metadata as Python values, tensors as views.

Why not `gguf.GGUFReader`: it builds numpy arrays for every part of every metadata string, so
opening a file with a 49k-token vocabulary takes 2.5 s in each process that reads it (server,
engine core, every tool). This parser decodes the same header in well under a second and
memory-maps the tensor data; dequantization stays with `gguf.quants`.

Layout (ggml's docs/gguf.md): magic "GGUF", version u32, tensor count u64, metadata count
u64; metadata = key string, value type u32, value; tensor infos = name, n_dims u32, dims u64
each (ne0 first: the number of columns), ggml type u32, offset u64 from the data section,
which starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `data(reader)` gives its bytes as a read-only view."""

    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (columns) first
    type_id: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class GGUFReader:
    """Parses the header once; tensor data stays in the memory map until read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        self._buf, self._pos = buf, 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3; big-endian "
                             "files are not supported)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._read("<I"))
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
            self.tensors.append(TensorInfo(name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-self._pos // align) * align
        del self._buf

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        start, self._pos = self._pos, self._pos + n
        return bytes(self._buf[start:self._pos]).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        item, count = self._read("<I"), self._read("<Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            arr = np.frombuffer(self._buf, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return arr.tolist()
        return [self._value(item) for _ in range(count)]

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [rows..., bytes per row] (what gguf.quants expects)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
        cols, rows = tensor.shape[0], tensor.shape[1:]
        row_bytes = cols // block * size
        n = row_bytes * int(np.prod(rows, dtype=np.int64))
        start = self.data_start + tensor.offset
        if start + n > self._map.size:
            raise ValueError(f"tensor {tensor.name} runs past the end of the file")
        return self._map[start:start + n].reshape(*reversed(rows), row_bytes)
