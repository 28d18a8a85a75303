"""The fused runtime's wing: a llama-family pass in one call into C (``runtime.py``; the C source beside it),
and its pool (``pool.py``); and what it is to the loading layer (``KIND``): ``--backend fused``, from a GGUF file
read alone where it covers the file, else over the transformers module, on the CPU where its C library was built."""

from __future__ import annotations

from pathlib import Path

from exactspec.backends.family import CONVERTED_FAMILIES
from exactspec.backends.fused.runtime import (
    PRODUCTS,
    PROMPT_POSITIONS,
    WEIGHTS,
    FusedRuntime,
    FusedUnavailable,
    gguf_unavailable,
    quantized8,
    unavailable,
)
from exactspec.backends.gguf_file import read_gguf
from exactspec.backends.runtime_kind import DraftGrade, RuntimeKind
from exactspec.errors import UsageError
from exactspec.logs import notice, verbose


def reads(path: Path) -> bool:
    """Whether ``path`` is a GGUF file that the fused runtime reads alone (no transformers conversion)."""
    return path.is_file() and path.suffix.lower() == ".gguf" and gguf_unavailable(read_gguf(path)) is None


def from_file(path: Path, threads: int | None = None, max_length: int | None = None) -> FusedRuntime | None:
    """The runtime read from the GGUF alone; None where it does not read this model directly
    (``gguf_unavailable``): it then runs from the file's transformers conversion, where the family's code covers
    the architecture; elsewhere one line says why. (Its team is PyTorch's threads; its cache, the model's length.)"""
    source = read_gguf(path)
    reason = gguf_unavailable(source)
    if reason is None:
        return FusedRuntime.from_gguf(source)
    if source.field("general.architecture") not in CONVERTED_FAMILIES:  # no conversion would run it
        raise UsageError(f"--backend fused cannot run {path.name}: {reason}")
    if verbose():
        notice(f"the fused runtime runs {path.name} from its transformers conversion: {reason}")
    return None


def draft_from_file(path: Path, grade: DraftGrade, vocabulary) -> FusedRuntime | None:
    """A draft model's draft-grade copy (``draft_grade.py``), where the fused runtime reads its GGUF alone; else None
    (it then drafts as loaded)."""
    from exactspec.backends.fused.draft_grade import DraftGradeRuntime

    source = read_gguf(path)
    if gguf_unavailable(source) is not None:
        return None
    return DraftGradeRuntime.of_file(source, grade, vocabulary)


def _over_model(model, gguf: Path | None, precision: str | None) -> FusedRuntime:
    return FusedRuntime(model, gguf=gguf)  # its own weights, whatever the precision asked


KIND = RuntimeKind(name="fused", label="exactspec's fused runtime", runtime=FusedRuntime, from_file=from_file,
                   reads=reads, from_model=_over_model, unavailable=unavailable, model_unavailable=unavailable,
                   weights="int8 or float16 weights of its own", draft_from_file=draft_from_file)

__all__ = ["KIND", "PRODUCTS", "PROMPT_POSITIONS", "WEIGHTS", "FusedRuntime", "FusedUnavailable", "from_file",
           "gguf_unavailable", "quantized8", "reads", "unavailable"]
