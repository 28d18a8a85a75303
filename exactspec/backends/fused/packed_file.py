"""The fused runtime's matrices of a GGUF file, repacked once and kept in exactspec's cache (``packed/`` under
``cache_root()``), memory-mapped on later starts: no block is decoded again.

A packed file is each matrix's bytes at 64-byte boundaries, written as each is packed (so a first start holds one
packed matrix at a time, not the model), then a header, then a trailer: an 8-byte magic, the header's length and its
CRC-32. The header (JSON) names the layout's version, the source file (its resolved path, size and modification
time: a changed source is another key) and per matrix (per part, for a matrix stored in two formats: each says
whether the next goes on with its rows) its format, shape, place and a checksum (CRC-32) of all its bytes (so too
per named array kept beside the matrices: a draft-grade copy's vocabulary and embeddings, ``draft_grade.py``), checked
at every start (the 1.5B's 1.2 GB in about 0.5 s, pages a first pass reads anyway: a checksum of sampled stretches,
1.7% of its bytes, let damage elsewhere give other tokens unsaid). A packed file that is truncated, whose header does
not parse, names a format the kernels do not know or whose checksums do not match is stale or corrupt: it is said so
in one line, deleted and written anew. Before a copy is packed, and as it is written, the kept copies of source files
that are gone or changed are deleted, and those of another layout version (one line: its model is packed again);
each start deletes the partial files of packings that were killed (their process gone).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exactspec.backends.fused.stored import StoredMatrix
from exactspec.backends.native import FORMAT, INTEGER_FORMAT
from exactspec.cachefile import cache_root

MAGIC = b"SDPACK\x00\x01"
LAYOUT_VERSION = 9  # the C kernels' block_q8x8, block_q8x16, block_q4x8, block_q5x8, super_q4k8, super_q5k8, super_q6x8
# and float tiles, and which GGUF formats each holds, and what a checksum covers; up it when any changes (a format
# added, as rows_q3r8 was, changes none: only a version that knows it writes it)
ALIGNMENT = 64


def packed_path(source: Path, narrow: bool = True) -> Path:
    """Where the packed matrices of ``source`` are kept: named after the file and its identity, and whether its
    4-bit and 6-bit formats are kept in 4 and 6 bits (for integer products; float products read them as bytes)."""
    identity = "|".join(map(str, _identity(source).values())) + f"|v{LAYOUT_VERSION}{'' if narrow else '|bytes'}"
    return cache_root() / "packed" / f"{source.stem}-{zlib.crc32(identity.encode()):08x}.sdpack"


def _identity(source: Path) -> dict:
    stat = source.stat()
    return {"path": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


@dataclass
class Packed:
    """What a packed file keeps: the matrices, named arrays beside them (a draft-grade copy's vocabulary and its
    embeddings), and notes (small values: how the file was made)."""

    matrices: list[StoredMatrix]
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)


def write(path: Path, source: Path, matrices: Iterable[StoredMatrix], arrays: dict[str, torch.Tensor] | None = None,
          notes: dict | None = None) -> None:
    """Write the matrices' packed bytes (their biases stay with the source) as they come, each let go once written,
    then ``arrays``' bytes, then the header (with ``notes``); atomically. Copies of gone or changed sources are
    deleted first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prune(path.parent)
    entries, stored, offset = [], [], 0
    partial = path.with_suffix(f".{os.getpid()}.partial")

    def put(f, tensor: torch.Tensor) -> dict:
        nonlocal offset
        data = _bytes_of(tensor)
        entry = {"dtype": str(tensor.dtype).removeprefix("torch."), "offset": offset, "bytes": len(data),
                 "crc": zlib.crc32(data)}
        f.seek(offset)
        f.write(data)
        offset += -(-len(data) // ALIGNMENT) * ALIGNMENT
        return entry

    try:
        with partial.open("wb") as f:
            for part in (part for matrix in matrices for part in matrix.parts()):
                entries.append({"format": part.format, "outputs": part.outputs, "inputs": part.inputs,
                                "rest": part.rest is not None} | put(f, part.packed))
            for name, array in (arrays or {}).items():
                stored.append({"name": name, "shape": list(array.shape)} | put(f, array))
            header = json.dumps({"version": LAYOUT_VERSION, "source": _identity(source), "matrices": entries,
                                 "arrays": stored, "notes": notes or {}}).encode()
            f.seek(offset)
            f.write(header + MAGIC + len(header).to_bytes(8, "little") + zlib.crc32(header).to_bytes(4, "little"))
            f.truncate()
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def prune(folder: Path) -> None:
    """Delete the packed copies in ``folder`` whose source file is gone or changed since, those of another layout
    (one line each: their model is packed again in this one), and unreadable ones."""
    for kept in folder.glob("*.sdpack"):
        try:
            with kept.open("rb") as f:
                layout = _checked_header(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            source = layout["source"]
            stale = not Path(source["path"]).is_file() or _identity(Path(source["path"])) != source
            if not stale and layout["version"] != LAYOUT_VERSION:
                print(f"exactspec: deleted {kept.name}, packed in layout version {layout['version']} (this "
                      f"exactspec's is {LAYOUT_VERSION}): its model is packed again", file=sys.stderr)
                stale = True
        except (OSError, ValueError, KeyError, TypeError):
            stale = True
        if stale:
            kept.unlink(missing_ok=True)


def remove_killed_partials(folder: Path) -> None:
    """Delete the partial files in ``folder`` of packings whose process is gone (killed while it wrote: a partial
    file can hold a whole model's bytes)."""
    for partial in folder.glob("*.partial"):
        pid = partial.suffixes[-2][1:] if len(partial.suffixes) >= 2 else ""
        if not pid.isdigit() or not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def read(path: Path) -> Packed | None:
    """What is kept at ``path`` (the bytes memory-mapped, copy-on-write), or None where there is no packed file; a
    stale or corrupt one is deleted, with one line saying so. Killed packings' partial files go first."""
    if path.parent.is_dir():
        remove_killed_partials(path.parent)
    if not path.is_file():
        if path.parent.is_dir():
            prune(path.parent)  # before a copy is packed: another layout's of the same model goes first
        return None
    try:
        return _read(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"exactspec: the packed copy {path.name} is stale or corrupt ({error}); packing it again",
              file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


TRAILER = len(MAGIC) + 12  # the magic, the header's length (8 bytes) and its CRC-32 (4)


def _header(mapped: mmap.mmap) -> dict:
    """A packed file's header, its trailer and checksum checked, of this layout; ``end``: where the matrices' bytes
    end."""
    layout = _checked_header(mapped)
    if layout["version"] != LAYOUT_VERSION:
        raise ValueError(f"layout version {layout['version']}, not {LAYOUT_VERSION}")
    return layout


def _checked_header(mapped: mmap.mmap) -> dict:
    """A packed file's header, of any layout, its trailer and checksum checked; ``end``: where the matrices' bytes
    end."""
    if len(mapped) < TRAILER or mapped[-TRAILER : -TRAILER + len(MAGIC)] != MAGIC:
        raise ValueError("not a packed file, or truncated")
    length = int.from_bytes(mapped[-12:-4], "little")
    header = mapped[len(mapped) - TRAILER - length : len(mapped) - TRAILER]
    if len(header) != length or zlib.crc32(header) != int.from_bytes(mapped[-4:], "little"):
        raise ValueError("its header's checksum does not match")
    return json.loads(header) | {"end": len(mapped) - TRAILER - length}


def _read(path: Path) -> Packed:
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    layout = _header(mapped)
    matrices, continued = [], False  # continued: the last entry's rows go on in this one (StoredMatrix.rest)
    for entry in layout["matrices"]:
        if entry["format"] not in FORMAT and entry["format"] not in INTEGER_FORMAT:
            raise ValueError(f"a matrix in format {entry['format']!r}, which the kernels do not know")
        packed = _checked(mapped, entry, layout["end"], "a matrix")
        part = StoredMatrix(entry["format"], entry["outputs"], entry["inputs"], packed)
        if continued:
            matrices[-1].parts()[-1].rest = part
        else:
            matrices.append(part)
        continued = entry["rest"]
    if continued:
        raise ValueError("its last matrix's parts end early")
    arrays = {entry["name"]: _checked(mapped, entry, layout["end"], f"array {entry['name']}").view(entry["shape"])
              for entry in layout.get("arrays", [])}
    return Packed(matrices, arrays, layout.get("notes", {}))


def _checked(mapped: mmap.mmap, entry: dict, end: int, what: str) -> torch.Tensor:
    """An entry's bytes as its dtype (a view of the mapped file), its place and checksum checked."""
    begin = entry["offset"]
    if begin + entry["bytes"] > end:
        raise ValueError("truncated")
    if zlib.crc32(memoryview(mapped)[begin : begin + entry["bytes"]]) != entry["crc"]:
        raise ValueError(f"{what}'s checksum does not match")
    dtype = getattr(torch, entry["dtype"])
    return torch.frombuffer(mapped, dtype=dtype, count=entry["bytes"] // dtype.itemsize, offset=begin)
