"""A GGUF file read as stored: its metadata, and each tensor's bytes memory-mapped where they lie, with nothing
de-quantised (the format: github.com/ggml-org/ggml, docs/gguf.md).

:func:`q8_rows` turns the block formats whose weights are w = d q + m per 32 values (Q4_0, Q4_1, Q8_0) into one
byte per weight with a float scale and offset per 32: what the C Q8 tiles hold, so the fused runtime repacks them
exactly and without searching for their grid. Shared below the runtimes' wings.
"""

from __future__ import annotations

import functools
import mmap
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exactspec.errors import UsageError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types read here: id -> (name, values per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
         6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 30: ("BF16", 1, 2), 12: ("Q4_K", 256, 144),
         13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # rows first, as PyTorch writes a weight: [out, in]
    data: np.ndarray  # uint8, the stored bytes (a view of the mapped file)


HEAD_NAMES = ("output.weight", "token_embd.weight")  # the LM head's tensor, or the embedding it is tied to


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
            with self.path.open("rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._mmap, dtype=np.uint8)
            self.metadata, self.tensors = self._parse()
        except (OSError, ValueError, struct.error, IndexError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {self.path} as a GGUF file: {error}") from None

    def _parse(self) -> tuple[dict, dict[str, Tensor]]:
        reader = _Reader(self._mmap)
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

    def streamed_bytes(self, bits: float | None = None, head_rows: int | None = None) -> int:
        """What a decoding step reads of the file's matrices: every tensor but the token embedding (whose rows are
        read as tokens come), and the LM head (the embedding, where the file ties them); each at ``bits`` a weight
        at most where given, the head's first ``head_rows`` rows where given."""
        total = 0
        for name, tensor in self.tensors.items():
            if name == "token_embd.weight" and "output.weight" in self.tensors:
                continue
            rows = tensor.shape[0]
            kept = min(head_rows, rows) if head_rows is not None and name in HEAD_NAMES else rows
            size = tensor.data.nbytes * kept // rows
            if bits is not None:
                size = min(size, int(np.prod(tensor.shape[1:])) * kept * bits // 8)
            total += size
        return total

    def vocabulary_digest(self) -> int | None:
        """A checksum of the file's tokenizer (its model and tokens), or None where it holds none: two files of the
        same digest tokenize alike."""
        tokens = self.field("tokenizer.ggml.tokens")
        if not isinstance(tokens, Strings):
            return None
        return zlib.crc32(str(self.field("tokenizer.ggml.model")).encode(), tokens.digest())

    def release(self) -> None:
        """Let go of the file's pages this process has read (they stay in the page cache, and are read again when
        touched): what a first start's packing reads of a large file is then not held at once."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


@functools.lru_cache(maxsize=4)
def _read_once(path: Path, size: int, modified_ns: int) -> GGUFFile:
    return GGUFFile(path)


_PARSING: dict[Path, threading.Lock] = {}  # a lock per file: two threads asking for one file parse it once
_PARSING_GUARD = threading.Lock()


def read_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at ``path``, its header parsed once per process while the file is unchanged (``--backend
    auto``'s check and the load read the same file; a vocabulary of 150k strings takes 0.2-0.5 s), once too where
    two threads ask at once (a draft model's loading reads its target's header beside the target's own)."""
    path = Path(path).resolve()
    if not path.is_file():
        return GGUFFile(path)  # its one line: not found
    stat = path.stat()
    with _PARSING_GUARD:
        lock = _PARSING.setdefault(path, threading.Lock())
    with lock:
        return _read_once(path, stat.st_size, stat.st_mtime_ns)


class Strings(Sequence):
    """A metadata array of strings, as stored from ``start`` in ``buffer``: its length known, its strings decoded
    (UTF-8) on first access."""

    def __init__(self, buffer: mmap.mmap, start: int, count: int, end: int) -> None:
        self._buffer, self._start, self._count, self._end, self._decoded = buffer, start, count, end, None

    def digest(self) -> int:
        """A checksum (CRC-32) of the strings as stored: two files whose vocabularies are the same have the same."""
        return zlib.crc32(memoryview(self._buffer)[self._start : self._end])

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if self._decoded is None:
            self._decoded = self._decode()
        return self._decoded[index]

    def _decode(self) -> list[str]:
        buffer, at, unpack, out = self._buffer, self._start, struct.unpack_from, []
        for _ in range(self._count):
            (length,) = unpack("<Q", buffer, at)
            out.append(buffer[at + 8 : at + 8 + length].decode("utf-8", errors="replace"))
            at += 8 + length
        return out


class _Reader:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.buffer):
            raise ValueError("the header runs past the end of the file (truncated?)")
        chunk = self.buffer[self.at : self.at + n]
        self.at += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8")

    def strings(self, count: int) -> Strings:
        """``count`` strings in a row (a vocabulary's 150k tokens and merges), stepped over here and decoded when
        first read: a tokenizer reads them from the file itself, and the runtimes never do."""
        buffer, start, at, end, unpack = self.buffer, self.at, self.at, len(self.buffer), struct.unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise ValueError("the header runs past the end of the file (truncated?)")
            at += 8 + unpack("<Q", buffer, at)[0]
        if at > end:
            raise ValueError("the header runs past the end of the file (truncated?)")
        self.at = at
        return Strings(buffer, start, count, at)

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
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata type {kind}")


def q8_rows(tensor: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix [rows, cols] stored in one of ``Q8_STORED``'s block formats as q (uint8 [rows, cols]) with
    w = d q + m per group of inputs, and d, m (float32 [rows, cols / group]; the group is 16 for Q6_K, 32 for the
    others): exactly the stored weights, since each format's weight is a float16 (or a float16 times a 6- or 8-bit
    integer) times an integer of at most 6 bits, plus an offset of the same kind, all exact in float32:

    - Q4_0: w = d (q - 8), so m = -8 d; Q5_0: w = d (q - 16); Q8_0: w = d q (q signed), kept as d (q + 128) - 128 d;
    - Q4_1 and Q5_1: w = d q + m, both stored;
    - Q4_K and Q5_K: 256 values with a float16 d and dmin, and per 32 a 6-bit scale and 6-bit min: w = (d sc) q -
      (dmin mn);
    - Q6_K: 256 values with a float16 d, and per 16 a signed 8-bit scale: w = (d sc) (q - 32).
    """
    rows, cols = tensor.shape[0], int(np.prod(tensor.shape[1:]))
    q, d, m = _BYTE_GRIDS[tensor.type_name](_blocks(tensor))
    return q.reshape(rows, cols), d.reshape(rows, -1), m.reshape(rows, -1)


def _blocks(tensor: Tensor) -> np.ndarray:  # uint8 [rows, blocks, block bytes]
    rows, cols = tensor.shape[0], int(np.prod(tensor.shape[1:]))
    block_values, block_bytes = next((values, size) for name, values, size in TYPES.values()
                                     if name == tensor.type_name)
    return tensor.data.reshape(rows, cols // block_values, block_bytes)


def k_rows(tensor: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """A Q4_K, Q5_K or Q6_K matrix [rows, cols] in its own integers: q (uint8 [rows, cols]); per 32 inputs (Q6_K:
    16) a scale (Q4_K, Q5_K: uint8 < 64; Q6_K: int8) and a min (uint8 < 64; Q6_K: None); per 256 inputs d and dmin
    (float32 [rows, cols / 256]; Q6_K: None): w = (d sc) q - (dmin mn), or (d sc) (q - 32), whose products d sc and
    dmin mn are q8_rows' scales and offsets, exactly."""
    rows, cols = tensor.shape[0], int(np.prod(tensor.shape[1:]))
    blocks = _blocks(tensor)
    if tensor.type_name in _K_VALUES:
        scales, mins = _k_scales(blocks[..., 4:16])
        q, d, dmin = _K_VALUES[tensor.type_name](blocks), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        return q.reshape(rows, cols), scales.reshape(rows, -1), mins.reshape(rows, -1), d, dmin
    q, scales, d = _q6_k_parts(blocks)
    return q.reshape(rows, cols), scales.reshape(rows, -1), None, d, None


def _f16(raw: np.ndarray) -> np.ndarray:  # [..., 2] uint8 -> [...] float32
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:  # [..., 16] -> [..., 32]: the low nibbles, then the high
    out = np.empty((*packed.shape[:-1], 32), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., :16])
    np.right_shift(packed, 4, out=out[..., 16:])
    return out


def _fifth_bits(high: np.ndarray) -> np.ndarray:  # [..., 4] uint8 (a little-endian uint32) -> [..., 32] bit i
    bits = np.unpackbits(high, axis=-1, bitorder="little")
    return np.left_shift(bits, 4, out=bits)


def _q4_0(blocks):
    d = _f16(blocks[..., :2])
    return _nibbles(blocks[..., 2:]), d, d * np.float32(-8)


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:]), _f16(blocks[..., :2]), _f16(blocks[..., 2:4])


def _q5_0(blocks):
    d = _f16(blocks[..., :2])
    return _nibbles(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6]), d, d * np.float32(-16)


def _q5_1(blocks):
    return _nibbles(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8]), _f16(blocks[..., :2]), _f16(blocks[..., 2:4])


def _q8_0(blocks):
    d = _f16(blocks[..., :2])
    return blocks[..., 2:] ^ np.uint8(0x80), d, d * np.float32(-128)  # q + 128 of a signed byte: its top bit flipped


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of scales as 8 six-bit scales and 8 six-bit mins: the first 4 of each in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); the last 4 in bytes 8-11's low (scales) and high (mins)
    nibbles, with their top 2 bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, last = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (last & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (last >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales, mins


def _k_grid(blocks: np.ndarray, q: np.ndarray):  # q [..., 256]: per 32 values, d sc and -dmin mn
    scales, mins = (t.astype(np.float32) for t in _k_scales(blocks[..., 4:16]))
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    return q, d * scales, -(dmin * mins)


def _k_low_nibbles(packed: np.ndarray) -> np.ndarray:  # [..., 128] -> [..., 256]
    """Each 32 bytes hold two groups of 32: the low nibbles, then the high."""
    halves = packed.reshape(*packed.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
    return (halves & 0x0F).reshape(*packed.shape[:-1], 256)


def _q4_k_values(blocks):
    return _k_low_nibbles(blocks[..., 16:144])


def _q5_k_values(blocks):
    high = blocks[..., 16:48]  # bit g of byte i is the fifth bit of value i of group g
    fifth = (high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_low_nibbles(blocks[..., 48:176]) | (fifth.reshape(*high.shape[:-1], 256) << 4)


_K_VALUES = {"Q4_K": _q4_k_values, "Q5_K": _q5_k_values}  # the K-quants with a scale and a min per 32


def _q4_k(blocks):
    return _k_grid(blocks, _q4_k_values(blocks))


def _q5_k(blocks):
    return _k_grid(blocks, _q5_k_values(blocks))


def _q6_k_parts(blocks):
    """128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales and a float16 d, as q [..., 256], the scales
    (int8 [..., 16]) and d (float32 [...]). Each half of 128 values takes 64 low bytes (values 0-63: their low
    nibbles; 64-127: their high) and 32 high bytes (bit pair j of byte i belongs to value 32 j + i)."""
    low, high = blocks[..., :128], blocks[..., 128:192]
    lead = blocks.shape[:-1]
    nibbles = low.reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]
    pairs = high.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    q = (nibbles & 0x0F).reshape(*lead, 256) | ((pairs & 0x03).reshape(*lead, 256) << 4)
    return q, blocks[..., 192:208].view(np.int8), _f16(blocks[..., 208:210])


def _q6_k(blocks):
    q, scales, d = _q6_k_parts(blocks)
    scale = d[..., None] * scales.astype(np.float32)
    return q, scale, scale * np.float32(-32)


_BYTE_GRIDS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
               "Q5_K": _q5_k, "Q6_K": _q6_k}
# w = d q + m per 32 (Q6_K: 16) values: kept exactly in one byte, a float scale and a float offset (q8_rows)
Q8_STORED = tuple(_BYTE_GRIDS)


def grid_group(type_name: str) -> int:
    """The inputs that share a scale and offset in :func:`q8_rows`' grid of a tensor of this type."""
    return 16 if type_name == "Q6_K" else 32


def dequantized(tensor: Tensor) -> np.ndarray:  # float32, the tensor's shape
    """The tensor's values in float32: F32, F16 and BF16 as stored, the block formats as d q + m (q8_rows)."""
    if tensor.type_name in Q8_STORED:
        q, d, m = q8_rows(tensor)
        group = q.shape[1] // d.shape[1]
        return (q.reshape(q.shape[0], -1, group) * d[..., None] + m[..., None]).reshape(tensor.shape).astype(np.float32)
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
