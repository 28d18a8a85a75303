"""The fused runtime's matrices of a GGUF file, repacked once and kept in specdec's cache (``packed/`` under
``cache_root()``), memory-mapped on later starts: no block is decoded again.

A packed file is a header, then each matrix's bytes at 64-byte boundaries. The header (JSON after an 8-byte magic
and its length) names the layout's version, the source file's identity (its resolved path, size and modification
time: a changed source is another key), and per matrix its format, shape, place and a checksum (CRC-32) of sampled
stretches of its bytes (its first, middle and last 64 KiB), and its own CRC-32 guards the header. A packed file
that is truncated, whose header does not parse or whose checksums do not match is stale or corrupt: it is said so in
one line, deleted and written anew.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import zlib
from pathlib import Path

import torch

from specdec.backends.fused.stored import StoredMatrix
from specdec.cachefile import cache_root

MAGIC = b"SDPACK\x00\x01"
LAYOUT_VERSION = 3  # fused.c's block_q8x8, block_q8x16, block_q4x8, block_q6x8 and float tiles; up it when a layout
# changes
ALIGNMENT = 64
SAMPLE = 65536  # bytes of each of a matrix's three sampled stretches


def packed_path(source: Path, narrow: bool = True) -> Path:
    """Where the packed matrices of ``source`` are kept: named after the file and its identity, and whether its
    4-bit and 6-bit formats are kept in 4 and 6 bits (for integer products; float products read them as bytes)."""
    stat = source.stat()
    identity = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{LAYOUT_VERSION}{'' if narrow else '|bytes'}"
    return cache_root() / "packed" / f"{source.stem}-{zlib.crc32(identity.encode()):08x}.sdpack"


def _sampled_crc(data: memoryview | bytes) -> int:
    size = len(data)
    middle = max(0, size // 2 - SAMPLE // 2)
    crc = zlib.crc32(data[:SAMPLE])
    crc = zlib.crc32(data[middle : middle + SAMPLE], crc)
    return zlib.crc32(data[max(0, size - SAMPLE) :], crc)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def write(path: Path, matrices: list[StoredMatrix]) -> None:
    """Write the matrices' packed bytes (their biases stay with the source), atomically."""
    entries, offset, datas = [], 0, [_bytes_of(matrix.packed) for matrix in matrices]
    for matrix, data in zip(matrices, datas):
        entries.append({"format": matrix.format, "outputs": matrix.outputs, "inputs": matrix.inputs,
                        "dtype": str(matrix.packed.dtype).removeprefix("torch."), "offset": offset,
                        "bytes": len(data), "crc": _sampled_crc(data)})
        offset += -(-len(data) // ALIGNMENT) * ALIGNMENT
    header = json.dumps({"version": LAYOUT_VERSION, "matrices": entries}).encode()
    header_crc = zlib.crc32(header).to_bytes(4, "little")
    start = -(-(len(MAGIC) + 8 + 4 + len(header)) // ALIGNMENT) * ALIGNMENT
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    with partial.open("wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header_crc + header)
        for data, entry in zip(datas, entries):
            f.seek(start + entry["offset"])
            f.write(data)
        f.truncate(start + offset)
    partial.replace(path)


def read(path: Path) -> list[StoredMatrix] | None:
    """The matrices kept at ``path`` (their bytes memory-mapped, copy-on-write), or None where there is no packed
    file; a stale or corrupt one is deleted, with one line saying so."""
    if not path.is_file():
        return None
    try:
        return _read(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"specdec: the packed copy {path.name} is stale or corrupt ({error}); packing it again",
              file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


def _read(path: Path) -> list[StoredMatrix]:
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if mapped[: len(MAGIC)] != MAGIC:
        raise ValueError("not a packed file")
    length = int.from_bytes(mapped[len(MAGIC) : len(MAGIC) + 8], "little")
    header_start = len(MAGIC) + 12
    header = mapped[header_start : header_start + length]
    if len(header) != length or zlib.crc32(header) != int.from_bytes(mapped[len(MAGIC) + 8 : header_start], "little"):
        raise ValueError("its header's checksum does not match")
    layout = json.loads(header)
    if layout["version"] != LAYOUT_VERSION:
        raise ValueError(f"layout version {layout['version']}, not {LAYOUT_VERSION}")
    start = -(-(header_start + length) // ALIGNMENT) * ALIGNMENT
    matrices = []
    for entry in layout["matrices"]:
        begin = start + entry["offset"]
        if begin + entry["bytes"] > len(mapped):
            raise ValueError("truncated")
        view = memoryview(mapped)[begin : begin + entry["bytes"]]
        if _sampled_crc(view) != entry["crc"]:
            raise ValueError("a matrix's checksum does not match")
        dtype = getattr(torch, entry["dtype"])
        packed = torch.frombuffer(mapped, dtype=dtype, count=entry["bytes"] // dtype.itemsize, offset=begin)
        matrices.append(StoredMatrix(entry["format"], entry["outputs"], entry["inputs"], packed))
    return matrices
