"""The roofline of a target on the machine it runs on: how close a decode step is to the weight-streaming floor,
and what scoring k+1 positions costs against one.

A decode step reads every weight once, so it can be no faster than the bytes of the weights over the memory
bandwidth: that is the floor. The bandwidth is measured in the same run, by summing a buffer as large as the
weights (far larger than any cache). Speculation pays in proportion to how little more a pass over k+1 positions
costs than a pass over one: those ratios are measured on the same cached context, all sizes interleaved.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from exactspec.backends.base import CausalLM, pass_seconds, sync
from exactspec.bench.stats import needed_acceptance

MAX_K = 16
BARS = (1.3, 1.6)  # speedups whose needed acceptance the roofline reports


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int  # read by one decode pass
    bandwidth: float  # bytes per second, by the probe
    step_seconds: float  # one decode pass (one position)
    score_ratios: dict[int, float]  # k -> time of one pass over k+1 positions / time of one decode pass

    @property
    def floor_seconds(self) -> float:
        return self.weight_bytes / self.bandwidth

    @property
    def step_over_floor(self) -> float:
        return self.step_seconds / self.floor_seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "floor_seconds": self.floor_seconds, "step_over_floor": self.step_over_floor}


def bandwidth_probe(nbytes: int, repeats: int = 7) -> float:
    """Bytes per second at which this machine reads a float32 buffer of ``nbytes`` (at least 256 MiB)."""
    buffer = torch.ones(max(nbytes, 2**28) // 4)
    buffer.sum()  # first touch
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(seconds)


def measure_roofline(backend: CausalLM, context: list[int], max_k: int = MAX_K, repeats: int = 5) -> Roofline:
    """Probe the bandwidth, then time passes over 1..max_k+1 positions after ``context``, interleaved."""
    bandwidth = bandwidth_probe(backend.weight_bytes)
    sync(backend, context, num_logits=0)
    sizes = range(1, max_k + 2)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):  # the first round warms up, and is dropped
        for n in sizes:
            elapsed = pass_seconds(backend, n)
            if repeat:
                seconds[n].append(elapsed)
    step = statistics.median(seconds[1])
    ratios = {n - 1: statistics.median(seconds[n]) / step for n in sizes if n > 1}
    return Roofline(weight_bytes=backend.weight_bytes, bandwidth=bandwidth, step_seconds=step, score_ratios=ratios)


def roofline_markdown(roofline: Roofline, label: str = "") -> str:
    ratios = roofline.score_ratios
    return "\n".join([
        f"**roofline{' — ' + label if label else ''}**: weights {roofline.weight_bytes / 1e6:.0f} MB, "
        f"bandwidth {roofline.bandwidth / 1e9:.1f} GB/s (probe), floor {roofline.floor_seconds * 1e3:.1f} ms, "
        f"decode step {roofline.step_seconds * 1e3:.1f} ms ({roofline.step_over_floor:.2f}x the floor)",
        "",
        "| k | " + " | ".join(str(k) for k in ratios) + " |",
        "|---|" + "---:|" * len(ratios),
        "| cost of k+1 positions / one | " + " | ".join(f"{r:.2f}" for r in ratios.values()) + " |",
        "",
        "Per-position acceptance a chain needs at these costs, from a drafter that costs nothing: "
        + "; ".join(_needed(bar, ratios) for bar in BARS) + ".",
        "",
    ])


def _needed(speedup: float, ratios: dict[int, float]) -> str:
    needed = needed_acceptance(speedup, ratios)
    return f"{speedup}x: " + ("out of reach" if needed is None else f"{needed[0]:.0%} (k = {needed[1]})")
