"""Draft-length policies: how many tokens to draft next round (0 = plain decoding).

The engine only asks; a policy learns from each round: the verdict (how many draft tokens were accepted) and what
the round cost (drafting, and the target's pass over k+1 positions).

- ``FixedDraftLength``: always k.
- ``HeuristicDraftLength`` (``--num-draft-tokens heuristic``): transformers' "heuristic" schedule: two more after
  a round whose whole draft was accepted, one fewer after a rejection.
- ``CostModelPolicy`` (``--num-draft-tokens auto``): the k that maximises expected tokens per second, from the
  acceptance measured online at each draft position and the measured costs of drafting and of scoring; 0 when
  speculation would not pay, the drafter's catching up (on the prompt, on rounds it did not draft) counted.
- ``TreePolicy`` (``--tree auto``): the same for a token tree's whole shape, candidates per depth.
"""

from __future__ import annotations

import math
from typing import Protocol

from exactspec.choices import MAX_TREE_WIDTH
from exactspec.costs import (
    AUTO_MAX_K,
    TRIAL_SHARE,
    Acceptance,
    PassCosts,
    SequenceLengths,
    TrialBudget,
    chained_rates,
    expected_tokens_by_k,
)
from exactspec.verify import TreeVerdict, Verdict

AUTO_TREE_MAX_NODES = 15  # the most nodes the tree policy considers (a pass over 16 positions)


class Policy(Protocol):
    name: str

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        """Draft length for the next round, at most ``max_k``. ``backlog``: the tokens the drafter would first catch
        up on (the prompt, rounds that drafted nothing; 0 where it is current or keeps no state); ``remaining``: the
        most tokens the sequence may still emit (None: no bound)."""
        ...

    def observe(self, verdict: Verdict | TreeVerdict, draft_seconds: float, target_seconds: float) -> None:
        """Learn from the round just verified: its verdict, the time spent drafting and the target's pass."""
        ...

    def tree_widths(self, depth: int) -> list[int]:
        """The candidates at each depth of the next round's tree, ``depth`` deep (a chain: one at each)."""
        ...

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The drafter caught up on a backlog of ``tokens`` in ``seconds`` before the round's draft (a policy that
        weighs no backlog ignores it)."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A sequence starts: the target prefilled ``tokens`` of its prompt in ``seconds`` (a policy that weighs no
        time ignores it)."""


class ChainShape(Policy):
    """What a policy that drafts chains answers for a tree's shape: one candidate at each depth."""

    def tree_widths(self, depth: int) -> list[int]:
        return [1] * depth


class FixedDraftLength(ChainShape):
    """Always draft the configured number of tokens."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        return min(self.k, max_k)

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        pass


class HeuristicDraftLength(ChainShape):
    """k + 2 after a fully accepted draft, k - 1 (at least 1) after a rejection, as transformers' "heuristic"."""

    name = "heuristic"

    def __init__(self, initial: int = 4, max_k: int = AUTO_MAX_K) -> None:
        self.k = initial
        self.max_k = max_k

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        return min(self.k, max_k)

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        proposed, accepted, _ = verdict.proposed
        if proposed == 0:
            return  # nothing was drafted: nothing learned about the draft length
        if accepted == proposed:
            self.k = min(self.k + 2, self.max_k)
        else:
            self.k = max(self.k - 1, 1)


class DraftGate:
    """Whether a round drafts at all, given the best draft the cost model found (its expected tokens and seconds):
    where that beats plain decoding per token, and the drafter's catching up before it (a draft model's prefill of
    the prompt, or of the rounds it did not draft) pays for itself over the tokens the sequence is expected to emit
    still (``SequenceLengths``); otherwise only as a trial, within a share of the time (``TrialBudget``). So a
    drafter that does not pay costs plain decoding at most that share, its catching up included."""

    def __init__(self, share: float = TRIAL_SHARE) -> None:
        self.trials = TrialBudget(share)
        self.lengths = SequenceLengths()

    def drafts(self, costs: PassCosts, tokens: float, seconds: float, backlog: int = 0,
               remaining: int | None = None) -> bool:
        """Whether a round expected to emit ``tokens`` in ``seconds`` drafts, after catching up on ``backlog``.
        Until a target pass is timed, round costs are in arbitrary units that a catch-up's seconds cannot be
        weighed against: a round with a backlog to catch up on then decodes plainly, and times a pass."""
        catching_up = costs.catch_up_seconds(backlog)
        if catching_up and not costs.score_seconds:
            return False
        plain = costs.scoring_seconds(1)
        saved = plain - seconds / tokens  # seconds saved per token emitted
        if saved > 0 and saved * self.lengths.expected_left(remaining) > catching_up:
            self.trials.reset()
            return True
        return self.trials.allows(catching_up + seconds - tokens * plain)

    def start(self, prefill_seconds: float) -> None:
        """A sequence starts, after the target's prefill: plain time, of which trials may spend a share."""
        self.lengths.start()
        self.trials.spend(prefill_seconds)

    def observe(self, verdict: Verdict | TreeVerdict, target_seconds: float) -> None:
        """The round's tokens count towards the sequence's length; a round that drafted nothing is plain time."""
        self.lengths.emitted(verdict.accepted + 1)
        if not verdict.proposed[0]:
            self.trials.spend(target_seconds)


class Gated(Policy):
    """A cost-model policy (its ``costs``) whose rounds draft only as its ``gate`` allows: what it learns of the
    drafter's catching up and of the target's prefills, which are plain time that trials may spend a share of."""

    costs: PassCosts
    gate: DraftGate

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self.costs.observe_catch_up(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.costs.observe_prefill(tokens, seconds)
        self.gate.start(seconds)


class CostModelPolicy(ChainShape, Gated):
    """Maximise expected tokens per second over k = 0..max_k.

    Expected tokens of a round drafting k: 1 + sum over i <= k of a_1 x ... x a_i, where a_i is the measured
    probability that draft position i is accepted once position i-1 was (each estimate shrunk towards the one
    before it while it has few observations, and old drafting rounds fading with ``decay``). Cost of the round: the
    measured drafting cost per draft token x k, plus the measured time of a target pass over k+1 positions
    (``PassCosts``). k = 0 is plain decoding; it is chosen where the best k does not beat it, or where the
    drafter would first catch up on a backlog that the tokens left do not repay (``DraftGate``); while it wins,
    a trial round drafts the best k for at most ``trial_share`` of the time, so that acceptance keeps being
    measured.
    """

    name = "auto"

    def __init__(self, max_k: int = AUTO_MAX_K, trial_share: float = TRIAL_SHARE, decay: float = 0.98,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0, prior_slope: float = 0.05) -> None:
        self.max_k = max_k
        self.gate = DraftGate(trial_share)
        self.decay = decay
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.costs = PassCosts(prior_slope)
        self.positions = [Acceptance() for _ in range(max_k)]  # [i-1]: draft position i, once position i-1 was

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        limit = min(max_k, self.max_k)
        if limit < 1:
            return 0
        tokens = self.expected_tokens_by_k()
        line = self.costs.score_line()
        seconds = [self.costs.round_seconds(k, k + 1, line) for k in range(limit + 1)]
        k = max(range(1, limit + 1), key=lambda i: tokens[i] / seconds[i])
        return k if self.gate.drafts(self.costs, tokens[k], seconds[k], backlog, remaining) else 0

    def observe(self, verdict: Verdict, draft_seconds: float, target_seconds: float) -> None:
        proposed, accepted, reached = verdict.proposed  # a grammar's forced tokens are not the drafter's
        if proposed:  # old evidence fades per drafting round, so sparse trials keep their memory
            for i, position in enumerate(self.positions, start=1):  # positions after the first rejection: untested
                position.observe(float(i <= accepted), float(i <= reached), self.decay)
        self.costs.observe(verdict.num_draft + 1, target_seconds, proposed, draft_seconds)
        self.gate.observe(verdict, target_seconds)

    def acceptances(self) -> list[float]:
        """[i-1]: estimated probability that draft position i is accepted, given that position i-1 was (each
        position's estimate shrunk towards the one before it)."""
        return chained_rates(self.positions, self.prior_acceptance, self.prior_weight)

    def expected_tokens_by_k(self) -> list[float]:
        """[k]: expected tokens from a round that drafts k (1 + the expected accepted length)."""
        return expected_tokens_by_k(self.acceptances())


class PlannedByDrafter(ChainShape):
    """The policy beside a drafter that plans its own rounds (``PlansRounds``: the hybrid, which chooses a source
    and its draft length by :class:`SourcePlan`): the draft length asked for only caps the draft, and each target
    pass is reported to the drafter."""

    def __init__(self, drafter, cap: int, name: str = "auto") -> None:
        self.drafter = drafter
        self.cap = cap
        self.name = name

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        return min(self.cap, max_k)

    def observe(self, verdict, draft_seconds: float, target_seconds: float) -> None:
        self.drafter.observe_pass(verdict.num_draft + 1, target_seconds)


class TreePolicy(Gated):
    """``--tree auto``: each round's tree shape (candidates per depth, so its depth and size) by the same cost
    model as ``-k auto``: the shape that maximises expected tokens per second.

    At each depth d the candidates are tried in order (the drafter's first choice, then its next ones). Measured:
    h_d(r), the probability that candidate r is accepted when depth d was reached and candidates 1..r-1 were
    refused (shrunk towards h_(d-1)(r) while observations are few; old rounds fade with ``decay``). A depth's
    first candidate continues the tree (the drafters' trees grow along their first choices), so a tree of widths
    w_1..w_D emits 1 + sum_d S_(d-1) x (1 - prod_(r <= w_d) (1 - h_d(r))) tokens, where S_d = h_1(1) x ... x h_d(1).
    For each depth and node count the best widths come from a small dynamic programme; the round's cost is the
    drafting per depth plus the target's pass over the nodes and the pending token (``PassCosts``). No tree (plain
    decoding) while it wins, or while the drafter's catching up would not pay (``DraftGate``), but for trials.
    """

    name = "auto-tree"

    def __init__(self, max_depth: int = 6, max_width: int = 8, max_nodes: int = AUTO_TREE_MAX_NODES,
                 trial_share: float = TRIAL_SHARE,
                 decay: float = 0.98, prior_first: float = 0.5, prior_next: float = 0.2, prior_weight: float = 2.0
                 ) -> None:
        self.max_depth, self.max_width, self.max_nodes = max_depth, max_width, max_nodes
        self.gate = DraftGate(trial_share)
        self.decay = decay
        self.prior = [prior_first] + [prior_next] * (max_width - 1)  # h(r) before anything is measured
        self.prior_weight = prior_weight
        self.costs = PassCosts()
        # [d-1][r-1]: candidate r at depth d, accepted over tried (once candidates 1..r-1 there were refused)
        self.candidates = [[Acceptance() for _ in range(max_width)] for _ in range(max_depth)]
        self.widths: list[int] = []  # the shape chosen for the round

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        """The depth of the next round's tree (its widths: :meth:`tree_widths`)."""
        tokens, seconds, widths = self._best_shape(min(max_k, self.max_depth))
        drafts = bool(widths) and self.gate.drafts(self.costs, tokens, seconds, backlog, remaining)
        self.widths = widths if drafts else []
        return len(self.widths)

    def tree_widths(self, depth: int) -> list[int]:
        """The chosen shape's widths, cut to ``depth`` (the engine may shorten a round near the length limit)."""
        return self.widths[:depth]

    def observe(self, verdict, draft_seconds: float, target_seconds: float) -> None:
        self.costs.observe(verdict.nodes + 1, target_seconds, verdict.num_draft, draft_seconds)
        self.gate.observe(verdict, target_seconds)
        offered = verdict.offered
        if not verdict.num_draft or not offered:
            return
        ranks = list(verdict.ranks)
        for d, row in enumerate(self.candidates):
            width = offered[d] if d < len(offered) else 0
            rank = ranks[d] if d < len(ranks) else None  # None: every candidate there was refused
            tried = min(width, rank or width, self.max_width)
            for r, candidate in enumerate(row):  # every count fades, the ones tried this round grow
                candidate.observe(float(rank is not None and r == rank - 1), float(r < tried), self.decay)

    def acceptances(self) -> list[list[float]]:
        """[d-1][r-1]: the estimated h_d(r)."""
        estimates, previous = [], self.prior
        for candidates in self.candidates:
            previous = [c.rate(prior, self.prior_weight) for c, prior in zip(candidates, previous)]
            estimates.append(previous)
        return estimates

    def _best_shape(self, depth_limit: int) -> tuple[float, float, list[int]]:
        """The tree with the best expected rate (tokens per second): its expected tokens, its round's seconds and
        its widths; (1, inf, []) for none."""
        h = self.acceptances()
        gain_by_width = []  # [d][w]: S_(d-1) x coverage of w candidates at depth d
        survive = 1.0
        for d in range(depth_limit):
            coverage, refused = [0.0], 1.0
            for r in range(self.max_width):
                refused *= 1 - h[d][r]
                coverage.append(1 - refused)
            gain_by_width.append([survive * c for c in coverage])
            survive *= h[d][0]
        # best[b]: (gain, widths) of trees exactly d deep with b nodes, for the depth d reached so far
        best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
        line = self.costs.score_line()
        chosen: tuple[float, float, list[int]] = (1.0, math.inf, [])  # (tokens, seconds, widths)
        for d in range(depth_limit):
            grown: dict[int, tuple[float, list[int]]] = {}
            for used, (gain, widths) in best.items():
                for w in range(1, self.max_width + 1):
                    if used + w > self.max_nodes:
                        break
                    candidate = (gain + gain_by_width[d][w], widths + [w])
                    if used + w not in grown or candidate[0] > grown[used + w][0]:
                        grown[used + w] = candidate
            best = grown
            for nodes, (gain, widths) in best.items():
                seconds = self.costs.round_seconds(d + 1, nodes + 1, line)
                if (1 + gain) / seconds > chosen[0] / chosen[1]:
                    chosen = (1 + gain, seconds, widths)
        return chosen


def tree_widths(tree: tuple[int, ...] | str | None, depth: int, policy: Policy | None = None) -> list[int] | None:
    """The candidates at each depth of a tree ``depth`` deep: ``tree``'s (its last repeating), or with ``auto`` the
    shape ``policy`` chose; None for a chain (no ``tree``)."""
    if tree is None:
        return None
    if tree == "auto":
        return policy.tree_widths(depth)
    return [tree[min(d, len(tree) - 1)] for d in range(depth)]


def draft_positions(tree: tuple[int, ...] | str | None, depth: int, policy: Policy | None = None) -> int:
    """Positions a draft ``depth`` deep takes in the target's pass, at most: its tokens, or its tree's nodes (with
    ``auto``, those of the shape ``policy`` chose, else the most any shape may take)."""
    if tree == "auto" and policy is None:
        return min(depth * MAX_TREE_WIDTH, AUTO_TREE_MAX_NODES)
    return depth if tree is None else sum(tree_widths(tree, depth, policy))


def fitted_depth(tree: tuple[int, ...] | str | None, depth: int, room: int, policy: Policy | None = None) -> int:
    """The deepest draft up to ``depth`` whose positions fit in ``room`` (``policy``: as ``draft_positions``)."""
    while depth > 0 and draft_positions(tree, depth, policy) > room:
        depth -= 1
    return depth


def make_policy(num_draft_tokens: int | str, tree: tuple[int, ...] | str | None = None) -> Policy:
    if tree == "auto":
        return TreePolicy()
    if num_draft_tokens == "auto":
        return CostModelPolicy()
    if num_draft_tokens == "heuristic":
        return HeuristicDraftLength()
    return FixedDraftLength(int(num_draft_tokens))
