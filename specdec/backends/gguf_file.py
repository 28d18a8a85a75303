"""A GGUF file read as stored: its metadata, and each tensor's bytes memory-mapped where they lie, with nothing
de-quantised (the format: github.com/ggml-org/ggml, docs/gguf.md).

:func:`q8_rows` turns the block formats whose weights are w = d q + m per 32 values (Q4_0, Q4_1, Q8_0) into one
byte per weight with a float scale and offset per 32: what fused.c's Q8 tiles hold, so the fused runtime repacks them
exactly and without searching for their grid. Shared below the runtimes' wings.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import UsageError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types read here: id -> (name, values per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
         30: ("BF16", 1, 2), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
Q8_STORED = ("Q4_0", "Q4_1", "Q8_0")  # w = d q + m per 32 values: kept exactly in one byte, a scale and an offset


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first, as PyTorch writes a weight: [out, in]
    data: np.ndarray  # uint8, the stored bytes (a view of the mapped file)


class GGUFFile:
    """The metadata and tensors of a GGUF file; a malformed or truncated file is one line naming it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UsageError(f"model file not found: {self.path}")
        with self.path.open("rb") as f:
            if f.read(4) != MAGIC:
                raise UsageError(f"not a GGUF file: {self.path}")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.metadata, self.tensors = self._parse()
        except (OSError, ValueError, struct.error, IndexError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {self.path} as a GGUF file: {error}") from None

    def _parse(self) -> tuple[dict, dict[str, Tensor]]:
        reader = _Reader(self._map)
        if reader.take(4) != MAGIC:
            raise ValueError("no GGUF magic")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        n_tensors, n_metadata = reader.scalar("<Q"), reader.scalar("<Q")
        metadata = {}
        for _ in range(n_metadata):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            infos.append((name, dims, reader.scalar("<I"), reader.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-reader.at // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            if kind not in TYPES:
                raise ValueError(f"tensor {name} has a type this reader does not know ({kind})")
            type_name, block, block_bytes = TYPES[kind]
            if dims[0] % block:
                raise ValueError(f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
            count = int(np.prod(dims))
            size = count // block * block_bytes
            begin = start + offset
            if begin + size > len(self._map):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            shape = tuple(int(d) for d in reversed(dims))  # ggml lists the fastest dimension first
            data = self._map[begin : begin + size].reshape(-1, dims[0] // block * block_bytes)
            tensors[name] = Tensor(name, type_name, shape, data)
        return metadata, tensors

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Reader:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.buffer):
            raise ValueError("the header runs past the end of the file (truncated?)")
        chunk = self.buffer[self.at : self.at + n].tobytes()
        self.at += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:  # read whole
                fmt = _SCALARS[item]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * struct.calcsize(fmt))))
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata type {kind}")


def q8_rows(tensor: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q8_0 matrix [rows, cols] as q (uint8 [rows, cols]) with w = d q + m, and d, m (float32
    [rows, cols / 32]), exactly the stored weights: Q4_1 stores d and m; Q4_0's w = d (q - 8) has m = -8 d, and
    Q8_0's w = d q (q signed) is d (q + 128) - 128 d. Each m is exact in float32 (d times a power of two)."""
    rows, cols = tensor.shape[0], int(np.prod(tensor.shape[1:]))
    groups = cols // 32
    kind = tensor.type_name
    block_bytes = TYPES[{"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}[kind]][2]
    blocks = tensor.data.reshape(rows, groups, block_bytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = d * np.float32(-128)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" \
            else d * np.float32(-8)
        packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # values 0-15 in the low nibbles, 16-31 high
    return q.reshape(rows, cols), d, m


def dequantized(tensor: Tensor) -> np.ndarray:  # float32, the tensor's shape
    """The tensor's values in float32: F32, F16 and BF16 as stored, Q4_0, Q4_1 and Q8_0 as d q + m."""
    if tensor.type_name in Q8_STORED:
        q, d, m = q8_rows(tensor)
        return (q.reshape(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(tensor.shape).astype(np.float32)
    raw = tensor.data.reshape(-1)
    if tensor.type_name == "F32":
        values = raw.view(np.float32)
    elif tensor.type_name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif tensor.type_name == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"tensor {tensor.name} is {tensor.type_name}, which is not read as floats here")
    return values.reshape(tensor.shape)
