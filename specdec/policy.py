"""Draft-length policies: how many tokens to draft next round (0 = plain decoding).

The engine only asks; a policy learns from each round: the verdict (how many draft tokens were accepted) and what
the round cost (drafting, and the target's pass over k+1 positions).

- ``FixedDraftLength``: always k.
- ``HeuristicDraftLength`` (``--num-draft-tokens heuristic``): transformers' "heuristic" schedule: two more after
  a round whose whole draft was accepted, one fewer after a rejection.
- ``CostModelPolicy`` (``--num-draft-tokens auto``): the k that maximises expected tokens per second, from the
  acceptance measured online at each draft position and the measured costs of drafting and of scoring; 0 when
  speculation would not pay.
"""

from __future__ import annotations

from typing import Protocol

from specdec.verify import Verdict

AUTO_MAX_K = 16  # the longest draft the cost-model policy considers
POLICY_NAMES = ("auto", "heuristic")


class Policy(Protocol):
    name: str

    def next_k(self, max_k: int) -> int:
        """Draft length for the next round, at most ``max_k``."""
        ...

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        """Learn from the round just verified: its verdict, the time spent drafting and the target's pass."""
        ...


class FixedDraftLength:
    """Always draft the configured number of tokens."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self, max_k: int) -> int:
        return min(self.k, max_k)

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        pass


class HeuristicDraftLength:
    """k + 2 after a fully accepted draft, k - 1 (at least 1) after a rejection, as transformers' "heuristic"."""

    name = "heuristic"

    def __init__(self, initial: int = 4, max_k: int = AUTO_MAX_K) -> None:
        self.k = initial
        self.max_k = max_k

    def next_k(self, max_k: int) -> int:
        return min(self.k, max_k)

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        if verdict.num_draft == 0:
            return  # nothing was drafted: nothing learned about the draft length
        if verdict.accepted == verdict.num_draft:
            self.k = min(self.k + 2, self.max_k)
        else:
            self.k = max(self.k - 1, 1)


class CostModelPolicy:
    """Maximise expected tokens per second over k = 0..max_k.

    Expected tokens of a round drafting k: 1 + sum over i <= k of a_1 x ... x a_i, where a_i is the measured
    probability that draft position i is accepted once position i-1 was (each estimate shrunk towards the one
    before it while it has few observations, and old drafting rounds fading with ``decay``). Cost of the round: the
    measured drafting cost per draft token x k, plus the measured time of a target pass over k+1 positions
    (fitted as a line in the number of positions over the sizes seen so far). k = 0 is plain decoding; while it
    wins, one round in ``explore_every`` drafts anyway, so that acceptance keeps being measured.
    """

    name = "auto"

    def __init__(self, max_k: int = AUTO_MAX_K, explore_every: int = 16, decay: float = 0.98,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0, prior_slope: float = 0.05) -> None:
        self.max_k = max_k
        self.explore_every = explore_every
        self.decay = decay
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.prior_slope = prior_slope  # extra cost per scored position, relative to one, before two sizes are seen
        self.reached = [0.0] * (max_k + 1)  # [i]: rounds whose draft position i was verified (decayed)
        self.accepted = [0.0] * (max_k + 1)  # [i]: ... and accepted
        self.score_seconds: dict[int, float] = {}  # positions scored -> moving average of the target's pass
        self.draft_seconds_per_token: float | None = None
        self.plain_streak = 0

    def next_k(self, max_k: int) -> int:
        limit = min(max_k, self.max_k)
        tokens = self.expected_tokens_by_k()
        line = self._score_line()
        rates = [tokens[k] / self.round_seconds(k, line) for k in range(limit + 1)]
        k = max(range(limit + 1), key=lambda i: rates[i])
        if k == 0 and limit > 0:
            self.plain_streak += 1
            if self.plain_streak >= self.explore_every:
                self.plain_streak = 0
                k = max(range(1, limit + 1), key=lambda i: rates[i])
        else:
            self.plain_streak = 0
        return k

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        if verdict.num_draft:  # old evidence fades per drafting round, so sparse exploration keeps its memory
            for i in range(1, self.max_k + 1):
                self.reached[i] *= self.decay
                self.accepted[i] *= self.decay
        for i in range(1, min(verdict.num_draft, self.max_k) + 1):
            if i > verdict.accepted + 1:
                break  # positions after the first rejection were never tested
            self.reached[i] += 1
            self.accepted[i] += i <= verdict.accepted
        positions = verdict.num_draft + 1
        previous = self.score_seconds.get(positions)
        self.score_seconds[positions] = target_seconds if previous is None else 0.8 * previous + 0.2 * target_seconds
        if verdict.num_draft:
            per_token = draft_seconds / verdict.num_draft
            previous = self.draft_seconds_per_token
            self.draft_seconds_per_token = per_token if previous is None else 0.8 * previous + 0.2 * per_token

    def acceptances(self) -> list[float]:
        """[i-1]: estimated probability that draft position i is accepted, given that position i-1 was."""
        estimates, estimate = [], self.prior_acceptance
        for i in range(1, self.max_k + 1):
            estimate = (self.accepted[i] + self.prior_weight * estimate) / (self.reached[i] + self.prior_weight)
            estimates.append(estimate)
        return estimates

    def expected_tokens_by_k(self) -> list[float]:
        """[k]: expected tokens from a round that drafts k (1 + the expected accepted length)."""
        totals, survive = [1.0], 1.0
        for a in self.acceptances():
            survive *= a
            totals.append(totals[-1] + survive)
        return totals

    def expected_tokens(self, k: int) -> float:
        return self.expected_tokens_by_k()[k]

    def round_seconds(self, k: int, line: tuple[float, float] | None = None) -> float:
        draft = (self.draft_seconds_per_token or 0.0) * k
        return draft + self.scoring_seconds(k + 1, line)

    def scoring_seconds(self, positions: int, line: tuple[float, float] | None = None) -> float:
        """The target's pass over ``positions`` positions: measured, or from a line through the sizes measured
        (``line``: that line's (intercept, slope), when the caller has it already)."""
        if positions in self.score_seconds:
            return self.score_seconds[positions]
        intercept, slope = line or self._score_line()
        return max(intercept + slope * positions, 1e-9)

    def _score_line(self) -> tuple[float, float]:
        """(intercept, slope) of the cost of a pass against its positions; a prior slope until two sizes are seen."""
        seen = self.score_seconds
        if len(seen) < 2:
            n, seconds = next(iter(seen.items()), (1, 1.0))  # arbitrary units until measured: only ratios matter
            base = seconds / (1 + self.prior_slope * (n - 1))
            return base * (1 - self.prior_slope), base * self.prior_slope
        xs, ys = list(seen), list(seen.values())
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return mean_y - slope * mean_x, slope


def make_policy(num_draft_tokens: int | str) -> Policy:
    if num_draft_tokens == "auto":
        return CostModelPolicy()
    if num_draft_tokens == "heuristic":
        return HeuristicDraftLength()
    return FixedDraftLength(int(num_draft_tokens))
