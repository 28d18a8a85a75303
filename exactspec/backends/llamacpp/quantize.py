"""``exactspec quantize``: a GGUF copy in a quantised type, made once, for a file whose rows llama.cpp computes
differently alone and in a pass (float weights, on this build), so that speculation keeps greedy output bit for bit.

llama.cpp's own quantizer (``llama_model_quantize``) writes the copy; the copy is then loaded and probed like any
GGUF, and the command says whether its rows are pass-invariant here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from exactspec.backends.base import rows_are_pass_invariant
from exactspec.backends.llamacpp.runtime import GGUFModel, LlamaCppLM, check_gguf_file, llama_cpp
from exactspec.choices import QUANTIZE_TYPES
from exactspec.cores import thread_count
from exactspec.errors import UsageError


def copy_path(source: Path, weight_type: str) -> Path:
    """Where the copy goes unless told: beside the source, its type in the name (``model.Q8_0.gguf``)."""
    return source.with_name(f"{source.stem}.{weight_type}.gguf")


def quantize(source: Path, out: Path, weight_type: str, threads: int | None = None) -> None:
    """Write ``source``'s weights in ``weight_type`` to ``out`` with llama.cpp's quantizer; one line on failure."""
    lib = llama_cpp()
    check_gguf_file(source)
    if out.resolve() == source.resolve():
        raise UsageError(f"cannot convert {source} onto itself: give another --out")
    if not out.parent.is_dir():
        raise UsageError(f"cannot convert {source}: the folder {out.parent} does not exist")
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{weight_type}")
    params.nthread = thread_count(threads)
    params.allow_requantize = True  # a quantised source too (converting Q4_1's blocks loses nothing more)
    failed = lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if failed:
        out.unlink(missing_ok=True)
        raise UsageError(f"cannot convert {source}: llama.cpp's quantizer refused it (an architecture or tensor "
                         f"type it cannot quantize, or {out.parent} is not writable)")


def run_quantize(args) -> int:
    weight_type = args.type.upper()
    source = Path(args.model)
    out = Path(args.out) if args.out else copy_path(source, weight_type)
    quantize(source, out, weight_type, args.threads)
    copy = LlamaCppLM(GGUFModel(out), max_length=64, threads=args.threads)
    size = out.stat().st_size / 1e6
    if rows_are_pass_invariant(copy):
        print(f"wrote {out} ({weight_type}, {size:.0f} MB): its rows are the same alone and in any pass on this "
              "build, so speculation keeps its greedy output bit for bit")
        return 0
    print(f"wrote {out} ({weight_type}, {size:.0f} MB), but its rows still depend on the pass on this build: "
          f"try another --type ({', '.join(QUANTIZE_TYPES)})")
    return 1
