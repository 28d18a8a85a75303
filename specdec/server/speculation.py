"""Load-aware speculation: at each step, how many draft tokens to score for each request, if any.

Speculation and batching spend the same idle arithmetic. One pass over T positions costs c(T): nearly flat while
the weights' streaming dominates, then rising linearly once the arithmetic does. A step over B requests with
m_i draft tokens for request i scores T = B + sum(m_i) positions and emits, in expectation,
B + sum_i (a_i + a_i^2 + ... + a_i^m_i) tokens, where a_i is the request's acceptance rate (the chance that a
draft token is accepted once the one before it was). The planner maximises expected tokens per second of the
step. For a given number m of draft tokens in the step the best are the m with the largest gains a_i^j, so it
sorts every offered draft token by gain and tries each m: at a small batch, where c is flat, every token that
may be accepted pays; at a large batch, where c(T) grows with T, none does and the whole batch decodes plainly.

c(T) is measured when the server starts (passes over 1, 2, 4, ... positions spread over the pool's slots) and
refined by every pass it runs; acceptance is measured per request and, as a prior for requests that have not
drafted yet, over all of them.
"""

from __future__ import annotations

import bisect
import time

from specdec.backends.batch import BatchedLlama, Row
from specdec.choices import SPECULATION_MODES

PRIOR_STRENGTH = 4.0  # draft tokens' worth of weight the all-requests rate has in a request's own estimate
GLOBAL_DECAY = 0.995  # per observed draft: the all-requests rate follows the recent traffic
COST_LEARNING_RATE = 0.1


class PassCost:
    """Seconds of one pass over T positions: the shape measured at start-up (points linearly interpolated, and
    extrapolated past the last), times a scale learnt from the passes the server runs.

    Only the scale is learnt: the passes run are mostly of a few sizes, and moving single points would bend the
    curve's shape, on which the choice depends (a step's value is tokens over seconds, so a common scale cancels
    out of the comparison but for the drafting time added to it)."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points:
            raise ValueError("need at least one measured pass")
        self.positions = sorted(points)
        self.seconds = [points[t] for t in self.positions]
        self.scale = 1.0

    def __call__(self, positions: int) -> float:
        return self.scale * self.measured(positions)

    def measured(self, positions: int) -> float:
        """The start-up measurement's seconds for a pass over ``positions``."""
        xs, ys = self.positions, self.seconds
        if len(xs) == 1:
            return ys[0] * positions / xs[0]
        i = min(max(bisect.bisect_left(xs, positions), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (positions - x0) / (x1 - x0), 1e-9)

    def observe(self, positions: int, seconds: float) -> None:
        """Move the scale towards what a pass over ``positions`` took against the measurement."""
        self.scale *= (seconds / self(positions)) ** COST_LEARNING_RATE

    @classmethod
    def measure(cls, pool: BatchedLlama, max_positions: int, context_length: int = 64, repeats: int = 2
                ) -> "PassCost":
        """Time passes over 1, 2, 4, ... max_positions positions, spread over up to all of the pool's slots,
        each slot holding ``context_length`` tokens; the pool is left as it was."""
        slots = [pool.open() for _ in range(pool.max_slots - len(pool.slots))]
        try:
            if not slots:
                raise ValueError("measuring the pass cost needs free slots")
            context_length = min(context_length, pool.max_length // 2)
            for slot in slots:
                pool.forward([Row(slot, [0] * context_length, 0)])
            points = {}
            positions = 1
            while True:
                points[positions] = min(_timed_pass(pool, slots, positions) for _ in range(repeats))
                if positions >= max_positions:
                    break
                positions = min(2 * positions, max_positions)
            return cls(points)
        finally:
            for slot in reversed(slots):
                pool.close(slot)


def _timed_pass(pool: BatchedLlama, slots: list, positions: int) -> float:
    rows = min(len(slots), positions)
    per_row = [positions // rows + (1 if r < positions % rows else 0) for r in range(rows)]
    lengths = [slot.length for slot in slots[:rows]]
    started = time.perf_counter()
    pool.forward([Row(slot, [0] * n, n) for slot, n in zip(slots, per_row)])
    elapsed = time.perf_counter() - started
    for slot, length in zip(slots, lengths):
        slot.length = length
    return elapsed


class Acceptance:
    """Accepted draft tokens over draft tokens that were reached (a rejected one ends the chain)."""

    def __init__(self) -> None:
        self.accepted = 0.0
        self.reached = 0.0

    def observe(self, accepted: float, reached: float, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.reached = self.reached * decay + reached

    def rate(self, prior: float, strength: float = PRIOR_STRENGTH) -> float:
        return (self.accepted + strength * prior) / (self.reached + strength)


class SpeculationPlanner:
    """Chooses each request's draft length for the next step: ``always`` all it was offered, ``never`` none,
    ``auto`` what maximises the step's expected tokens per second."""

    def __init__(self, mode: str, cost: PassCost | None = None) -> None:
        if mode not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}")
        if mode == "auto" and cost is None:
            raise ValueError("auto speculation needs the measured pass cost")
        self.mode = mode
        self.cost = cost
        self.acceptance = Acceptance()  # over all requests, decayed
        self.draft_seconds_per_token = 0.0  # measured, averaged

    @property
    def drafts(self) -> bool:
        return self.mode != "never"

    def prior(self) -> float:
        return self.acceptance.rate(prior=0.5)

    def draft_lengths(self, offered: list[int], rates: list[float]) -> list[int]:
        """Draft tokens to score per request, given the draft tokens each was offered and its acceptance rate."""
        if self.mode == "always":
            return list(offered)
        if self.mode == "never" or not any(offered):
            return [0] * len(offered)
        gains = sorted(((rate**j, i) for i, (n, rate) in enumerate(zip(offered, rates)) for j in range(1, n + 1)),
                       reverse=True)
        batch = len(offered)
        best_count, best_rate, expected = 0, batch / self.cost(batch), float(batch)
        for count, (gain, _) in enumerate(gains, start=1):
            expected += gain
            seconds = self.cost(batch + count) + self.draft_seconds_per_token * count
            if expected / seconds > best_rate:
                best_count, best_rate = count, expected / seconds
        lengths = [0] * batch
        for _, i in gains[:best_count]:
            lengths[i] += 1
        return lengths

    def observe_pass(self, positions: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe(positions, seconds)

    def observe_drafting(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_seconds_per_token = 0.9 * self.draft_seconds_per_token + 0.1 * seconds / tokens

    def observe_verdict(self, accepted: float, reached: float) -> None:
        self.acceptance.observe(accepted, reached, GLOBAL_DECAY)
