"""A fast reader for a GGUF file's header: metadata and tensor directory, no tensor data.

gguf.GGUFReader parses every field into numpy views and takes seconds on a large vocabulary;
start-up only needs a few scalars, so this reads the header with struct and numpy.frombuffer.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# GGML tensor types pagewire reads: id -> (name, elements per block, bytes per block). The
# first eight are dequantized with torch (executor/gguf_weights.py); the rest through gguf-py.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18),
              3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
              14: ("Q6_K", 256, 210), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
              10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 13: ("Q5_K", 256, 176),
              20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17)}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]    # numpy order (outermost first): GGUF's dims reversed
    ggml_type: int
    offset: int               # absolute byte offset in the file


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges), as string() reads each, in
        one loop with no call per string but the decode: a 1B model has ~400k of them."""
        buf, pos, length, out = self.buf, self.pos, _U64.unpack_from, []
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"corrupt GGUF: unknown value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse metadata and the tensor directory. Raises ValueError on a file that is not GGUF
    or whose header is cut short."""
    with open(path, "rb") as f:
        data = np.memmap(f, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    try:
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    except struct.error as e:
        raise ValueError(f"{path}: GGUF header is truncated or corrupt ({e})") from None
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = {name: TensorInfo(name, shape, t, start + off) for name, shape, t, off in infos}
    return GGUFHeader(metadata, tensors)


def check_tensors(path: str, header: GGUFHeader) -> None:
    """Every tensor is of a type we read and lies whole inside the file; else a ValueError
    naming the file and the tensor (a download cut short shows up here, not mid-load)."""
    size = os.path.getsize(path)
    for t in header.tensors.values():
        if t.ggml_type not in GGML_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has GGML type {t.ggml_type}, which "
                             f"pagewire cannot read (it reads "
                             f"{', '.join(n for n, _, _ in GGML_TYPES.values())})")
        _, block, type_size = GGML_TYPES[t.ggml_type]
        count = int(np.prod(t.shape))
        end = t.offset + count // block * type_size
        if count % block or end > size:
            raise ValueError(f"{path}: truncated or corrupt GGUF: tensor {t.name} needs bytes "
                             f"{t.offset}..{end}, the file has {size}")
