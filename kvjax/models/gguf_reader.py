"""GGUF's container, read: the header, the metadata, the tensor table, and each tensor's bytes
memory-mapped (llama.cpp's `gguf.md`, versions 2 and 3, little-endian).

The `gguf` package's `GGUFReader` reads the same, but it wraps every element of every array
in numpy views: Qwen2.5's 151,936 tokens and 151,387 merges took it 12 s. Here a string
array is one Python loop over its length-prefixed strings (0.3 s), a number array one
`np.frombuffer`. Every tensor's extent is checked against the file's size, so a truncated
file is named as one ("truncated: N of M bytes") instead of failing inside numpy.
tests/test_gguf.py holds the metadata and tensors equal to `GGUFReader`'s.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

# GGUF value types: 0-7, 10-12 fixed-size numbers, 8 a string, 9 an array
_NUM = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
        10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    kind: str  # llama.cpp's type name: "F32", "Q4_K", ...
    n_elements: int
    data: np.ndarray  # its bytes, uint8, memory-mapped


@dataclasses.dataclass
class File:
    path: Path
    version: int
    fields: dict  # key -> a str, a number, a bool, or a list of them
    tensors: list[Tensor]


def type_name(code: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(code).name
    except ValueError:
        return f"unknown type {code}"


class _Cursor:
    def __init__(self, buf: memoryview, path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated: its metadata runs past its "
                             f"{len(self.buf)} bytes")
        b = self.buf[self.at:self.at + n]
        self.at += n
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return str(self.take(self.unpack("<Q")), "utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _NUM:
            x = np.frombuffer(self.take(np.dtype(_NUM[kind]).itemsize), _NUM[kind])[0]
            return x.item()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: metadata value type {kind} is not one of GGUF's")
        elem, count = self.unpack("<I"), self.unpack("<Q")
        if elem == _STRING:
            out = []
            for _ in range(count):  # the hot loop: struct and slicing, no numpy per item
                n = struct.unpack_from("<Q", self.buf, self.at)[0]
                self.at += 8
                out.append(str(self.take(n), "utf-8"))
            return out
        if elem in _NUM:
            dt = np.dtype(_NUM[elem])
            return np.frombuffer(self.take(count * dt.itemsize), dt).tolist()
        return [self.value(elem) for _ in range(count)]  # arrays of arrays


def read(path: str | Path) -> File:
    """The file's metadata and tensor table, its tensors' bytes memory-mapped; one
    `ValueError` naming the file when it is not GGUF, not a version this reads, or
    truncated."""
    from kvjax.models import quants

    path = Path(path)
    mm = np.memmap(path, np.uint8, mode="r")
    c = _Cursor(memoryview(mm), path)
    if len(mm) < 24 or bytes(c.take(4)) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    version = c.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported; supported: 2, 3 "
                         "(little-endian)")
    n_tensors, n_fields = c.unpack("<Q"), c.unpack("<Q")
    fields = {}
    for _ in range(n_fields):
        key = c.string()
        fields[key] = c.value(c.unpack("<I"))
    table = []
    for _ in range(n_tensors):
        name = c.string()
        shape = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        table.append((name, shape, type_name(c.unpack("<I")), c.unpack("<Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-c.at // align) * align
    tensors, need = [], c.at  # (the data region, aligned, exists only with tensors)
    for name, shape, kind, offset in table:
        count = int(np.prod(shape, dtype=np.int64))
        size = quants.nbytes(kind, count) if kind in quants.TYPES else 0
        tensors.append((name, shape, kind, count, start + offset, start + offset + size))
        need = max(need, start + offset + size)
    if need > len(mm):
        raise ValueError(f"{path}: truncated: {len(mm)} of {need} bytes; download or join "
                         "it again")
    return File(path, version, fields,
                [Tensor(n, s, k, count, mm[a:b]) for n, s, k, count, a, b in tensors])
