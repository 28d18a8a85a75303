"""``--dtype auto``: the fastest weight precision for each kind of target pass that keeps the target's outputs.

Each candidate precision is measured on the machine it will run on, against float32 on the same probe:

- its **logit error**: the largest difference from float32's logits over a probe sequence. A candidate is
  admitted only when that error is at most ``MAX_LOGIT_ERROR``: its probabilities then stay within
  e^(2 x 0.1) - 1 = 22% of float32's, relatively, and its greedy choice differs from float32's only where
  float32's two best logits lie within 2 x ``MAX_LOGIT_ERROR`` of each other (a near-tie);
- its **time** for a decode pass (one position), a scoring pass (``SCORED_POSITIONS`` positions) and a bulk
  pass (``BULK_TIMED`` positions: prefill, a large batch), the candidates interleaved so that the machine's noise
  falls on all alike.

The admitted candidate fastest at decode and scoring passes together is chosen for every kind of pass (one
precision keeps each position's logits the same in any pass); float32 is always admitted. The choice is kept in
the exactspec cache, keyed by model, machine, threads and PyTorch version, so the measurement runs once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from exactspec.backends.base import median_pass_seconds
from exactspec.backends.lean.runtime import LeanRuntime
from exactspec.backends.linear import BULK_POSITIONS, PRECISIONS, PassPrecisions
from exactspec.cachefile import MeasurementCache

MAX_LOGIT_ERROR = 0.1  # the largest logit difference from float32 that auto admits
PROBE_TOKENS = 128  # the probe sequence whose logits are compared
SCORED_POSITIONS = 5  # a scoring pass as timed: k+1 at the default k=4
BULK_TIMED = 2 * BULK_POSITIONS  # a bulk pass as timed
REPEATS = 5  # timed passes per candidate and kind; the median is kept
CACHE = MeasurementCache("precisions.json", version=4)  # 2: with the bulk pass; 3: one precision for every
# pass; 4: the row kernels


@dataclass(frozen=True)
class PrecisionMeasurement:
    precision: str
    decode_ms: float  # one position
    score_ms: float  # SCORED_POSITIONS positions
    bulk_ms: float  # BULK_TIMED positions
    max_logit_error: float  # against float32 on the probe

    @property
    def admitted(self) -> bool:
        return self.max_logit_error <= MAX_LOGIT_ERROR


def auto_precisions(model) -> PassPrecisions:
    """The measured choice for ``model`` on this machine, from the cache when it was measured before."""
    key = _cache_key(model)
    cached = CACHE.get(key)
    if cached is not None:
        return PassPrecisions(**cached)
    chosen = choose(measure(model))
    CACHE.put(key, asdict(chosen))
    return chosen


def choose(measurements: list[PrecisionMeasurement]) -> PassPrecisions:
    """One precision for every kind of pass: the admitted one whose decode and scoring passes take least time
    together. Weights in two precisions would make a position's logits depend on the pass that computed it, and
    speculation or batching could then change a token; in one, the runtime computes each row as it does alone."""
    admitted = [m for m in measurements if m.admitted]
    return PassPrecisions.uniform(min(admitted, key=lambda m: m.decode_ms + m.score_ms).precision)


def measure(model, candidates: tuple[str, ...] = PRECISIONS, seed: int = 0) -> list[PrecisionMeasurement]:
    """Time and compare each candidate precision on a probe of random tokens (float32 is the reference)."""
    candidates = ("float32",) + tuple(c for c in candidates if c != "float32")
    runtimes = [LeanRuntime(model, precision) for precision in candidates]
    probe = torch.randint(0, runtimes[0].vocab_size, (PROBE_TOKENS,), generator=torch.Generator().manual_seed(seed))
    logits = [runtime.extend(probe.tolist(), PROBE_TOKENS).float() for runtime in runtimes]  # each [probe, vocab]
    seconds = median_pass_seconds(dict(zip(candidates, runtimes)), (1, SCORED_POSITIONS, BULK_TIMED), REPEATS)
    return [
        PrecisionMeasurement(
            precision=precision,
            decode_ms=1000 * seconds[precision][1],
            score_ms=1000 * seconds[precision][SCORED_POSITIONS],
            bulk_ms=1000 * seconds[precision][BULK_TIMED],
            max_logit_error=float((logit - logits[0]).abs().max()),
        )
        for precision, logit in zip(candidates, logits)
    ]


def _cache_key(model) -> str:
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    parameters = sum(p.numel() for p in model.parameters())
    return CACHE.key(f"{name} | {parameters} parameters")
