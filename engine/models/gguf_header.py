"""A GGUF file's header (metadata and tensor table) read in one pass, its tensors as views of
the mapped file.

`gguf`'s own `GGUFReader` builds a numpy view for every part of every field: ~250,000 views for
SmolLM2's 49,152-token vocabulary and its merges, ~2 s of a load that should take one. This
reads the same layout (llama.cpp's gguf.md: versions 2 and 3, either byte order) with `struct`
and keeps `gguf`'s names for the types.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), as the weights are used
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 view of the file: shape[:-1] + (bytes per row,)


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # scalars as Python values, strings as str, arrays as lists/ndarrays
    tensors: list[TensorInfo]
    data_offset: int


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.pos, self.order = buf, 0, order

    def take(self, fmt: str):
        value, = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.take(_SCALARS[kind])
        item, count = GGUFValueType(self.take("I")), self.take("Q")
        if item in _SCALARS and item != GGUFValueType.BOOL:
            dtype = np.dtype(_SCALARS[item]).newbyteorder(self.order)
            arr = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += arr.nbytes
            return arr
        if item == GGUFValueType.STRING:  # a vocabulary: ~100,000 of them, one tight loop
            return self.strings(count)
        return [self.value(item) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            n, = length(buf, pos)
            out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        if pos > len(buf):
            raise ValueError("a string runs past the end of the file")
        self.pos = pos
        return out


def read_header(path: Path) -> GGUFHeader:
    """Raises ValueError (or struct.error) on a file that is not GGUF or is cut short."""
    with open(path, "rb") as fh:
        # private (copy on write): the tensor views are writable for torch, never written
        buf = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY))
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] in (2, 3) else ">"
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (supported: 2, 3)")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        table.append((name, tuple(reversed(dims)), GGMLQuantizationType(cur.take("I")),
                      cur.take("Q")))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"invalid alignment {align}: must be a power of two")
    data_offset = -(-cur.pos // align) * align
    tensors = []
    for name, shape, qtype, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row = shape[-1] if shape else 1
        if row % block:
            raise ValueError(f"tensor {name}: row of {row} is not whole {qtype.name} blocks")
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        n = rows * (row // block) * block_bytes
        start = data_offset + offset
        if start + n > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(buf, np.uint8, n, start).reshape(*shape[:-1], n // rows)
        tensors.append(TensorInfo(name, shape, qtype, data))
    return GGUFHeader(fields, tensors, data_offset)
