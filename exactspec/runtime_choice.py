"""Which runtime runs a target: ``--backend`` settled and checked (:func:`resolve_backend`), and for ``auto`` on the
CPU the runtime that runs the target fastest on this machine, by measurement.

The candidates: llama.cpp (a .gguf target, its weights as stored), exactspec's fused runtime (``backends/fused/``,
where it was built, the CPU has AVX2/FMA/F16C and the model is one it covers) and exactspec's lean runtime
(``backends/lean/``, in float16 where fbgemm runs it, else float32). Each is loaded, fed the same context, and timed
on a decode pass (one position) and a scoring pass (``SCORED_POSITIONS``), interleaved so that the machine's noise
falls on all alike. The one whose two passes take least time together is chosen. The measure is the same whatever
drafter runs, so the choice is too: a drafter never decides which runtime computes the target's tokens.

The choice is kept in the exactspec cache, keyed by the model file, the machine, the threads and the versions, so the
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

from exactspec.backends import DEFAULT, RuntimeKind, kind, kinds, over_model
from exactspec.backends.base import median_pass_seconds
from exactspec.cachefile import MeasurementCache, file_identity
from exactspec.choices import canonical_backend
from exactspec.logs import PROCESS_WIDE, notice, verbose
from exactspec.models import load_model, model_path

CACHE = MeasurementCache("backends.json", version=3)  # 2: the lean runtime on the row kernels; 3: its name
CONTEXT_TOKENS = 64  # cached before the timed passes
SCORED_POSITIONS = 5  # a scoring pass: k+1 at the default k=4
MEASURED_POSITIONS = 256  # what a measured runtime's cache holds: the context and a timed pass (little memory)
REPEATS = 5  # timed passes per candidate and kind; the median is kept


def resolve_backend(backend: str, path: str | os.PathLike | None, dtype: str = "auto", device: str = "auto",
                    threads: int | None = None) -> str:
    """``--backend`` settled: a runtime as named (or by an old name, ``choices.BACKEND_ALIASES``; one line naming
    those known for any other; ``models.load_model`` checks that it can run the target as asked, once); auto, on
    the CPU with the weights' precision left to the backend (--dtype auto), the runtime measured fastest for this
    target on this machine (:func:`auto_backend`); the default runtime (``backends.DEFAULT``) otherwise."""
    backend = canonical_backend(backend)
    if backend != "auto":
        return kind(backend).name
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not (on_cpu and dtype == "auto"):
        return DEFAULT
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


def candidates(gguf: bool, source: Path | None = None) -> tuple[list[RuntimeKind], list[tuple[str, str]]]:
    """The runtimes that --backend auto measures for a target here (those that declare ``measured_by_auto``, and
    run a file of its kind), and the (runtime, reason) of those that cannot run on this machine at all (their
    unfitness for a model is found at load).

    Where a runtime that builds over a transformers module also reads a GGUF ``source`` alone (the fused runtime),
    the runtimes that run the file only from its transformers conversion (the lean runtime, which runs the same
    model in PyTorch and has not been measured faster than the fused one anywhere) are not candidates: measuring
    them would convert the file (minutes and several times its size in memory for a model of billions of weights)
    to build a runtime that cannot win."""
    chosen, passed_by = [], []
    for runtime in kinds():
        if not runtime.measured_by_auto or (runtime.gguf_only and not gguf):
            continue
        reason = runtime.unavailable()
        if reason is not None:
            passed_by.append((runtime.label, reason))
        else:
            chosen.append(runtime)
    if gguf and source is not None and any(k.from_file is not None and not k.gguf_only and k.reads(source)
                                           for k in chosen):
        chosen = [k for k in chosen if k.from_file is not None]
    return chosen, passed_by


def fused_reads(source: Path) -> bool:
    """Whether ``source`` is a GGUF file that the fused runtime reads from the file alone (for bench/figures.py's
    figure 1, which sets llama.cpp and the fused runtime side by side by name)."""
    return kind("fused").reads(source)


@functools.cache
def _passed_by(label: str, reason: str) -> None:
    """Say once per process why --backend auto passes a runtime by."""
    notice(f"--backend auto passes {label} by: {reason}")


def auto_backend(source: Path, gguf: bool, threads: int | None = None) -> str:
    """The measured choice for the target at ``source``, from the cache when it was measured before (a path that
    does not exist is left to the default runtime's loader, which says so)."""
    if not source.exists():
        return DEFAULT  # whose loader says so
    runtimes, passed_by = candidates(gguf, source)
    names = [runtime.name for runtime in runtimes]
    key = _cache_key(source, names, threads)
    cached = CACHE.get(key)
    if cached is not None:  # said when it was measured
        return cached["backend"]
    if verbose():  # a few seconds, once; the summary line names the choice
        notice(f"measuring which of {', '.join(names)} runs {source.name} fastest on this machine (once; cached)")
    with _quiet_unless_verbose():  # what loading each candidate says is said again by the one that runs
        measurements, unfit = measure(source, runtimes, threads)
    for label, reason in passed_by + unfit:  # once, as the choice is made: a build that failed, a model not covered
        _passed_by(label, reason)
    chosen = choose(measurements)
    CACHE.put(key, {"backend": chosen, "measurements": [asdict(m) for m in measurements]})
    return chosen


def measure(source: Path, runtimes: list[RuntimeKind], threads: int | None = None
            ) -> tuple[list[BackendMeasurement], list[tuple[str, str]]]:
    """Load each candidate and time its decode and scoring passes after the same context, and why any candidate
    could not run the model. Where every candidate reads the GGUF alone (llama.cpp, and the fused runtime where no
    lean one is measured) they are loaded, timed and let go one at a time, so that a first start holds one
    model's weights; else those over a transformers model share it, and are timed interleaved."""
    gguf = source if source.suffix.lower() == ".gguf" else None
    if gguf is not None and all(runtime.from_file is not None for runtime in runtimes):
        measured = []
        for runtime in runtimes:
            measured += _timed({runtime.name: runtime.from_file(source, threads, MEASURED_POSITIONS)})
            gc.collect()  # its weights go before the next one's come
        return measured, []
    built, passed_by = {}, []
    model = None  # the transformers model, loaded once for the candidates built over one
    for runtime in runtimes:
        if runtime.gguf_only:
            built[runtime.name] = runtime.from_file(source, threads, MEASURED_POSITIONS)
            continue
        if model is None:
            model = load_model(source, dtype="float32", device="cpu", backend=DEFAULT).model
        reason = runtime.model_unavailable(model)
        if reason is not None:
            passed_by.append((runtime.label, reason))
        else:
            built[runtime.name] = over_model(runtime, model, gguf, runtime.auto_precision())
    return _timed(built), passed_by


def _timed(runtimes: dict) -> list[BackendMeasurement]:
    """The runtimes' median decode and scoring passes after the same context (their turns interleaved)."""
    context = [(7 + 31 * i) % min(r.vocab_size for r in runtimes.values()) for i in range(CONTEXT_TOKENS)]
    for runtime in runtimes.values():
        runtime.extend(context, 0)
    seconds = median_pass_seconds(runtimes, (1, SCORED_POSITIONS), REPEATS)
    return [BackendMeasurement(name, 1000 * seconds[name][1], 1000 * seconds[name][SCORED_POSITIONS])
            for name in runtimes]


@contextlib.contextmanager
def _quiet_unless_verbose():
    """Nothing on stderr (notices, conversion lines, progress bars) while the candidates load, unless --verbose;
    one thread at a time (``logs.PROCESS_WIDE``)."""
    if verbose():
        yield
        return
    from exactspec.logs import NOTICES

    with PROCESS_WIDE:
        level = NOTICES.level
        NOTICES.setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # the GGUF's conversion line, among others
                yield
        finally:
            NOTICES.setLevel(level)


def _cache_key(source: Path, names: list[str], threads: int | None) -> str:
    return CACHE.key(f"{file_identity(source)} | {'/'.join(names)}", threads)
