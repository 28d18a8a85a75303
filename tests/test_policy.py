"""Draft-length policies on synthetic acceptance and cost traces."""

from __future__ import annotations

import random

import pytest

from exactspec.policy import CostModelPolicy, FixedDraftLength, HeuristicDraftLength, TreePolicy, make_policy
from exactspec.verify import TreeVerdict, Verdict


def verdict(num_draft: int, accepted: int) -> Verdict:
    return Verdict(num_draft=num_draft, accepted=accepted, token=0)


def run_trace(policy, rounds: int, acceptance: float, score_seconds, draft_seconds_per_token: float = 0.0,
              seed: int = 0) -> list[int]:
    """Drive a policy with draft tokens each accepted with probability ``acceptance`` (independently, until the
    first rejection) and a target pass costing ``score_seconds(positions)``; the k it chose, round by round."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.next_k(16)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.observe(verdict(k, accepted), draft_seconds_per_token * k, score_seconds(k + 1))
        chosen.append(k)
    return chosen


def test_fixed_and_named_policies():
    assert FixedDraftLength(5).next_k(3) == 3 and FixedDraftLength(5).next_k(8) == 5
    assert isinstance(make_policy("auto"), CostModelPolicy)
    assert isinstance(make_policy("heuristic"), HeuristicDraftLength)
    assert make_policy(6).next_k(16) == 6


def test_heuristic_grows_after_full_acceptance_and_shrinks_after_rejection():
    policy = HeuristicDraftLength(initial=4, max_k=8)
    trajectory = []
    for num_draft, accepted in [(4, 4), (6, 6), (8, 8), (8, 2), (7, 0), (6, 0), (0, 0), (5, 5)]:
        policy.observe(verdict(num_draft, accepted), 0.0, 0.0)
        trajectory.append(policy.next_k(16))
    assert trajectory == [6, 8, 8, 7, 6, 5, 5, 7]  # capped at 8; an empty draft teaches nothing
    for _ in range(10):
        policy.observe(verdict(3, 0), 0.0, 0.0)
    assert policy.next_k(16) == 1  # never below one


def test_cost_model_turns_speculation_off_where_drafts_are_rejected():
    policy = CostModelPolicy()
    chosen = run_trace(policy, 400, acceptance=0.02, score_seconds=lambda n: 1 + 0.2 * (n - 1))
    late = chosen[200:]
    assert late.count(0) >= 0.9 * len(late)  # plain decoding, but for the exploring rounds
    assert 0 < sum(k > 0 for k in late) <= len(late) / policy.exploration.every + 1


def test_cost_model_drafts_long_where_drafts_are_accepted_and_scoring_is_cheap():
    chosen = run_trace(CostModelPolicy(), 400, acceptance=0.9, score_seconds=lambda n: 1 + 0.03 * (n - 1))
    assert min(chosen[200:]) >= 8


def test_cost_model_balances_acceptance_against_the_cost_of_scoring():
    """alpha = 0.6, a pass over n positions costing 1 + 0.15 (n - 1): expected tokens per unit time,
    (1 - a^(k+1)) / (1 - a) / (1 + 0.15 k), peaks at k = 2 (1.505) over k = 1 (1.391) and k = 3 (1.491)."""
    rates = {k: (1 - 0.6 ** (k + 1)) / 0.4 / (1 + 0.15 * k) for k in range(17)}
    assert max(rates, key=rates.get) == 2
    chosen = run_trace(CostModelPolicy(), 1500, acceptance=0.6, score_seconds=lambda n: 1 + 0.15 * (n - 1))
    late = chosen[500:]
    assert sum(k in (2, 3) for k in late) >= 0.8 * len(late)


def test_measured_acceptance_gives_the_expected_tokens_of_independent_acceptance():
    policy = CostModelPolicy(decay=1.0)
    run_trace(policy, 3000, acceptance=0.7, score_seconds=lambda n: 1.0)  # free scoring: it drafts the most
    expected = (1 - 0.7 ** 5) / (1 - 0.7)
    assert policy.expected_tokens_by_k()[4] == pytest.approx(expected, rel=0.05)


def test_a_grammars_forced_tokens_teach_the_policies_nothing_about_the_drafter():
    """Forced tokens lead a constrained draft and are accepted by construction: the policies learn the drafter's
    acceptance from its own tokens only. A drafter whose tokens are always rejected, behind 3 forced tokens each
    round, turns speculation off as it would with none; the same rounds read as 4 drafter tokens, 3 accepted, would
    not."""
    policy, unaware, chosen = CostModelPolicy(), CostModelPolicy(), []
    for _ in range(400):
        k = policy.next_k(16)
        chosen.append(k)
        policy.observe(Verdict(num_draft=3 + k, accepted=3, token=0, forced=3), 0.0, 1 + 0.2 * (3 + k))
        unaware.observe(Verdict(num_draft=4, accepted=3, token=0), 0.0, 1.8)
    late = chosen[200:]
    assert late.count(0) >= 0.9 * len(late) and policy.acceptances()[0] < 0.1  # plain, but for exploring rounds
    assert unaware.acceptances()[0] > 0.9
    heuristic = HeuristicDraftLength(initial=4)
    heuristic.observe(Verdict(num_draft=7, accepted=3, token=0, forced=3), 0.0, 0.0)
    assert heuristic.next_k(16) == 3  # a rejection: one fewer (read as 3 of 7 accepted would be the same)
    heuristic.observe(Verdict(num_draft=6, accepted=6, token=0, forced=3), 0.0, 0.0)
    assert heuristic.next_k(16) == 5  # the drafter's 3 all accepted: two more
    heuristic.observe(Verdict(num_draft=3, accepted=3, token=0, forced=3), 0.0, 0.0)
    assert heuristic.next_k(16) == 5  # forced tokens only: nothing drafted, nothing learned


def test_drafting_cost_shortens_the_draft():
    cheap = run_trace(CostModelPolicy(), 600, acceptance=0.8, score_seconds=lambda n: 1 + 0.05 * (n - 1))
    costly = run_trace(CostModelPolicy(), 600, acceptance=0.8, score_seconds=lambda n: 1 + 0.05 * (n - 1),
                       draft_seconds_per_token=0.4)
    assert sum(costly[300:]) < sum(cheap[300:])


def run_tree_trace(policy: TreePolicy, rounds: int, candidate_acceptance: list[float], score_seconds,
                   seed: int = 0) -> list[list[int]]:
    """Drive the tree policy: at every depth, candidate r (1-based) is accepted with probability
    ``candidate_acceptance[r-1]`` when those before it were refused; the first candidate continues the tree. The
    target's pass costs ``score_seconds(positions)``. The widths chosen, round by round."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        depth = policy.next_k(16)
        widths = policy.tree_widths(depth)
        offered, ranks = [], []
        for width in widths:
            offered.append(width)
            rank = next((r + 1 for r in range(width) if rng.random() < candidate_acceptance[r]), None)
            if rank is None:
                break
            ranks.append(rank)
            if rank > 1:
                break  # a sibling of the first candidate is a leaf
        else:
            offered.append(0)  # the last accepted node has no child: a bonus token
        verdict = TreeVerdict(num_draft=depth, path=list(range(len(ranks))), token=0, bonus=False,
                              nodes=sum(widths), offered=tuple(offered), ranks=tuple(ranks))
        policy.observe(verdict, 0.0, score_seconds(sum(widths) + 1))
        chosen.append(widths)
    return chosen


def test_tree_policy_widens_within_the_pass_sizes_that_cost_no_more():
    """A pass costs the same up to 6 positions and twice as much past them (as fbgemm's half-precision kernel
    here, whose row blocks are 6): the policy learns to use the 5 free nodes, on several candidates at the first
    depth where the first is often refused, and to stay under the step."""
    step = lambda n: 1.0 if n <= 6 else 2.0  # noqa: E731
    chosen = run_tree_trace(TreePolicy(), 800, [0.4, 0.3, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05], step)
    late = chosen[400:]
    assert sum(sum(w) == 5 for w in late) >= 0.9 * len(late)
    assert sum(w[0] >= 2 for w in late) >= 0.9 * len(late)


def test_tree_policy_turns_speculation_off_where_nothing_is_accepted():
    policy = TreePolicy()
    chosen = run_tree_trace(policy, 400, [0.01] * 8, lambda n: 1 + 0.2 * (n - 1))
    late = chosen[200:]
    assert sum(not w for w in late) >= 0.9 * len(late)
    assert 0 < sum(bool(w) for w in late) <= len(late) / policy.exploration.every + 1


def test_tree_policy_grows_a_deep_chain_where_first_choices_are_accepted_and_passes_are_cheap():
    chosen = run_tree_trace(TreePolicy(), 600, [0.9] + [0.05] * 7, lambda n: 1 + 0.02 * (n - 1))
    late = chosen[300:]
    assert sum(len(w) == 6 for w in late) >= 0.9 * len(late)  # its deepest tree, max_depth
    assert make_policy(4, "auto").name == "auto-tree"
