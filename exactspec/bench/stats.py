"""The arithmetic of benchmark reports: speedups, expected tokens per round, and the ideal speedup.

Pure functions over measured numbers, so that they can be tested on synthetic timings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def expected_tokens_per_round(acceptance_rate: float, k: float) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens a round emits when each of k draft tokens survives with probability a,
    independently, and the round ends with one recovered or bonus token."""
    if not 0 <= acceptance_rate <= 1:
        raise ValueError(f"acceptance rate must be in [0, 1], got {acceptance_rate}")
    if acceptance_rate == 1:
        return k + 1
    return (1 - acceptance_rate ** (k + 1)) / (1 - acceptance_rate)


def ideal_speedup(
    acceptance_rate: float, k: float, draft_seconds_per_round: float, score_seconds_per_round: float,
    plain_seconds_per_token: float,
) -> float:
    """Speedup over plain decoding implied by the acceptance and the measured costs, with no other overhead:
    expected tokens per round, divided by the cost of a round (drafting plus one target pass over k+1
    positions) in units of one plain decoding step."""
    return round_speedup(expected_tokens_per_round(acceptance_rate, k), draft_seconds_per_round,
                         score_seconds_per_round, plain_seconds_per_token)


def round_speedup(tokens_per_round: float, draft_seconds_per_round: float, score_seconds_per_round: float,
                  plain_seconds_per_token: float) -> float:
    """Speedup over plain decoding of rounds that emit ``tokens_per_round`` tokens and cost drafting plus one
    target pass, with no other overhead: tokens per round over a round's cost in plain decoding steps."""
    return tokens_per_round * plain_seconds_per_token / (draft_seconds_per_round + score_seconds_per_round)


def needed_acceptance(speedup: float, score_ratios: dict[int, float], tolerance: float = 1e-4
                      ) -> tuple[float, int] | None:
    """The lowest per-position acceptance at which a chain from a drafter that costs nothing reaches ``speedup``
    over plain decoding, given what a pass over k+1 positions costs against one (``score_ratios``, k -> ratio),
    and the draft length k that reaches it; None if no acceptance below 1 does. Real drafters cost something
    and accept less further down a draft, so this is a lower bound on what they need."""

    def best(rate: float) -> tuple[float, int]:
        return max((expected_tokens_per_round(rate, k) / ratio, k) for k, ratio in score_ratios.items())

    if not score_ratios or best(1.0)[0] < speedup:
        return None
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if best(middle)[0] >= speedup else (middle, high)
    return high, best(high)[1]


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def geomean(values: Iterable[float]) -> float:
    """The geometric mean of positive values (a mean of ratios: a 2x and a 0.5x make 1x); NaN of none."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the two nearest values; NaN of none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def per_prompt_speedups(tokens_per_second: dict[str, float], baseline: dict[str, float]) -> list[float]:
    """Speedup on each prompt that both ran: its tokens/s over the baseline's tokens/s on the same prompt."""
    return [tokens_per_second[p] / baseline[p] for p in tokens_per_second if p in baseline and baseline[p] > 0]
