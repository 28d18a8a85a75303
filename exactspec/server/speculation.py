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

from exactspec.choices import SPECULATION_MODES
from exactspec.costs import Acceptance, MeasuredPassCosts

GLOBAL_DECAY = 0.995  # per observed draft: the all-requests rate follows the recent traffic


class SpeculationPlanner:
    """Chooses each request's draft length for the next step: ``always`` all it was offered, ``never`` none,
    ``auto`` what maximises the step's expected tokens per second."""

    def __init__(self, mode: str, cost: MeasuredPassCosts | None = None) -> None:
        if mode not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {mode!r}")
        if mode == "auto" and cost is None:
            raise ValueError("auto speculation needs the measured pass cost")
        self.mode = mode
        self.cost = cost
        self.acceptance = Acceptance()  # over all requests, decayed
        self.draft_seconds_per_token = 0.0  # measured, averaged

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes a request may ask for here: ``never`` always; ``always`` where the server drafts; ``auto``
        where it measured its pass costs."""
        return {"never": ("never",), "always": ("always", "never"), "auto": ("auto", "always", "never")}[self.mode]

    def prior(self) -> float:
        return self.acceptance.rate(prior=0.5)

    def draft_lengths(self, offered: list[int], rates: list[float], modes: list[str] | None = None) -> list[int]:
        """Draft tokens to score per request, given the draft tokens each was offered, its acceptance rate and
        its mode (by default the server's): ``always`` all, ``never`` none, and for the ``auto`` ones the tokens
        that maximise the step's expected tokens per second, beside those of the others."""
        modes = modes or [self.mode] * len(offered)
        lengths = [n if mode == "always" else 0 for n, mode in zip(offered, modes)]
        chosen = [i for i, mode in enumerate(modes) if mode == "auto" and offered[i]]
        if not chosen:
            return lengths
        gains = sorted(((rates[i] ** j, i) for i in chosen for j in range(1, offered[i] + 1)), reverse=True)
        positions = len(offered) + sum(lengths)  # the step's positions before any auto request's draft
        expected = len(offered) + sum(rates[i] ** j for i, n in enumerate(lengths) for j in range(1, n + 1))
        best_count, best_rate = 0, expected / self._seconds(positions, sum(lengths))
        for count, (gain, _) in enumerate(gains, start=1):
            expected += gain
            rate = expected / self._seconds(positions + count, sum(lengths) + count)
            if rate > best_rate:
                best_count, best_rate = count, rate
        for _, i in gains[:best_count]:
            lengths[i] += 1
        return lengths

    def _seconds(self, positions: int, draft_tokens: int) -> float:
        """A step's expected seconds: the target pass over ``positions`` and drafting ``draft_tokens``."""
        return self.cost(positions) + self.draft_seconds_per_token * draft_tokens

    def observe_pass(self, positions: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe(positions, seconds)

    def observe_drafting(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_seconds_per_token = 0.9 * self.draft_seconds_per_token + 0.1 * seconds / tokens

    def observe_verdict(self, accepted: float, reached: float) -> None:
        self.acceptance.observe(accepted, reached, GLOBAL_DECAY)
