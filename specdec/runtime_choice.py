"""Which runtime runs a target: ``--backend`` settled and checked (:func:`resolve_backend`), and for ``auto`` on the
CPU the runtime that runs the target fastest on this machine, by measurement.

The candidates: llama.cpp (a .gguf target, its weights as stored), specdec's fused runtime (``backends/fused/``,
where it was built, the CPU has AVX2/FMA/F16C and the model is one it covers) and specdec's lean runtime
(``backends/lean/``, in float16 where fbgemm runs it, else float32). Each is loaded, fed the same context, and timed
on a decode pass (one position) and a scoring pass (``SCORED_POSITIONS``), interleaved so that the machine's noise
falls on all alike. The one whose two passes take least time together is chosen. The measure is the same whatever
drafter runs, so the choice is too: a drafter never decides which runtime computes the target's tokens.

The choice is kept in the specdec cache, keyed by the model file, the machine, the threads and the versions, so the
measurement (a few seconds) runs once. ``--backend NAME`` skips it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.backends.base import median_pass_seconds
from specdec.cachefile import MeasurementCache
from specdec.choices import parse_backend
from specdec.logs import notice, verbose
from specdec.models import load_model, model_path

CACHE = MeasurementCache("backends.json", version=3)  # 2: the lean runtime on the row kernels; 3: its name
CONTEXT_TOKENS = 64  # cached before the timed passes
SCORED_POSITIONS = 5  # a scoring pass: k+1 at the default k=4
MEASURED_POSITIONS = 256  # what a measured runtime's cache holds: the context and a timed pass
REPEATS = 5  # timed passes per candidate and kind; the median is kept


def resolve_backend(backend: str, path: str | os.PathLike | None, dtype: str = "auto", device: str = "auto",
                    threads: int | None = None) -> str:
    """``--backend`` settled: lean, fused or llama.cpp as named (or by an old name, ``choices.BACKEND_ALIASES``;
    ``models.load_model`` checks that it can run the target as asked, once); auto, on the CPU with the weights'
    precision left to the backend (--dtype auto), the runtime measured fastest for this target on this machine
    (:func:`auto_backend`; llama.cpp a candidate for a .gguf target, the default model among them); lean
    otherwise."""
    backend = parse_backend(backend)
    if backend != "auto":
        return backend
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not (on_cpu and dtype == "auto"):
        return "lean"
    source = model_path(path)
    return auto_backend(source, source.suffix.lower() == ".gguf", threads)


@dataclass(frozen=True)
class BackendMeasurement:
    backend: str
    decode_ms: float
    score_ms: float

    @property
    def cost_ms(self) -> float:
        return self.decode_ms + self.score_ms


def choose(measurements: list[BackendMeasurement]) -> str:
    return min(measurements, key=lambda m: m.cost_ms).backend


def candidates(gguf: bool, source: Path | None = None) -> tuple[list[str], list[str]]:
    """The runtimes that may run a target here, and why the fused runtime may not where it may not (its unfitness
    for a model is found at load). Where the fused runtime reads a GGUF ``source`` from the file alone, the lean
    runtime, which runs the same model in PyTorch from a transformers conversion and has not been measured faster
    than it anywhere, is not a candidate: measuring it would convert the file (minutes and several times its size
    in memory for a model of billions of weights) to build a runtime that cannot win."""
    from specdec.backends.fused import unavailable

    reason = unavailable()
    names = (["llama.cpp"] if gguf else []) + (["fused"] if reason is None else [])
    if reason is not None or not (gguf and source is not None and fused_reads(source)):
        names.append("lean")
    return names, [] if reason is None else [reason]


def fused_reads(source: Path) -> bool:
    """Whether ``source`` is a GGUF file that the fused runtime reads from the file alone."""
    if not (source.is_file() and source.suffix.lower() == ".gguf"):
        return False
    from specdec.backends.fused import gguf_unavailable
    from specdec.backends.gguf_file import read_gguf

    return gguf_unavailable(read_gguf(source)) is None


@functools.cache
def _passed_by(reason: str) -> None:
    """Say once per process why --backend auto passes the fused runtime by."""
    notice(f"--backend auto passes specdec's fused runtime by: {reason}")


def auto_backend(source: Path, gguf: bool, threads: int | None = None) -> str:
    """The measured choice for the target at ``source``, from the cache when it was measured before (a path that
    does not exist is left to the first candidate's loader, which says so)."""
    if not source.exists():
        return "llama.cpp" if gguf else "lean"
    names, passed_by = candidates(gguf, source)
    key = _cache_key(source, names, threads)
    cached = CACHE.get(key)
    if cached is not None:  # said when it was measured
        return cached["backend"]
    if verbose():  # a few seconds, once; the summary line names the choice
        notice(f"measuring which of {', '.join(names)} runs {source.name} fastest on this machine (once; cached)")
    with _quiet_unless_verbose():  # what loading each candidate says is said again by the one that runs
        measurements, unfit = measure(source, names, threads)
    for reason in passed_by + unfit:  # once, as the choice is made: a build that failed, a model not covered
        _passed_by(reason)
    chosen = choose(measurements)
    CACHE.put(key, {"backend": chosen, "measurements": [asdict(m) for m in measurements]})
    return chosen


def measure(source: Path, names: list[str], threads: int | None = None
            ) -> tuple[list[BackendMeasurement], list[str]]:
    """Load each candidate and time its decode and scoring passes after the same context, and why any candidate
    could not run the model. Candidates that read a GGUF alone (llama.cpp, and the fused runtime where no lean one
    is measured) are loaded, timed and let go one at a time, so that a first start holds one model's weights; those
    over a transformers model share it, and are timed interleaved."""
    if "lean" not in names:
        measured = []
        for name in names:
            measured += _timed({name: _file_runtime(name, source, threads)})
            gc.collect()  # its weights go before the next one's come
        return measured, []
    runtimes, passed_by = {}, []
    model = None  # the transformers model, loaded once for the fused and lean candidates
    for name in names:
        if name == "llama.cpp":
            runtimes[name] = _file_runtime(name, source, threads)
            continue
        if model is None:
            model = load_model(source, dtype="float32", device="cpu", backend="lean").model
        runtime = _runtime(name, model, source if source.suffix.lower() == ".gguf" else None)
        if isinstance(runtime, str):
            passed_by.append(runtime)
        else:
            runtimes[name] = runtime
    return _timed(runtimes), passed_by


def _file_runtime(name: str, source: Path, threads: int | None):
    """llama.cpp's runtime of a GGUF (its context as long as the measurement needs, not the model's: its cache and
    buffers then take little memory), or the fused runtime read from it alone."""
    if name == "llama.cpp":
        from specdec.backends.llamacpp import LlamaCppLM

        return LlamaCppLM.load(source, max_length=MEASURED_POSITIONS, threads=threads)
    from specdec.backends.fused import FusedRuntime

    return FusedRuntime.from_gguf(source)


def _timed(runtimes: dict) -> list[BackendMeasurement]:
    """The runtimes' median decode and scoring passes after the same context (their turns interleaved)."""
    context = [(7 + 31 * i) % min(r.vocab_size for r in runtimes.values()) for i in range(CONTEXT_TOKENS)]
    for runtime in runtimes.values():
        runtime.extend(context, 0)
    seconds = median_pass_seconds(runtimes, (1, SCORED_POSITIONS), REPEATS)
    return [BackendMeasurement(name, 1000 * seconds[name][1], 1000 * seconds[name][SCORED_POSITIONS])
            for name in runtimes]


def _runtime(name: str, model, gguf: Path | None):
    """The fused or lean candidate over a transformers model (converted from ``gguf``, if given), or why the fused
    runtime does not cover it."""
    if name == "fused":
        from specdec.backends.fused import FusedRuntime, unavailable

        reason = unavailable(model)
        return reason if reason is not None else FusedRuntime(model, gguf=gguf)
    from specdec.backends import make_backend
    from specdec.backends.linear import has_fbgemm

    return make_backend(model, "float16" if has_fbgemm() else "float32")


@contextlib.contextmanager
def _quiet_unless_verbose():
    """Nothing on stderr (notices, conversion lines, progress bars) while the candidates load, unless --verbose."""
    if verbose():
        yield
        return
    from specdec.logs import NOTICES

    level = NOTICES.level
    NOTICES.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF's conversion line, among others
            yield
    finally:
        NOTICES.setLevel(level)


def _cache_key(source: Path, names: list[str], threads: int | None) -> str:
    stat = source.stat() if source.is_file() else None
    fingerprint = f"{source.resolve()} {stat.st_size} {int(stat.st_mtime)}" if stat else str(source.resolve())
    return CACHE.key(f"{fingerprint} | {'/'.join(names)}", threads)
