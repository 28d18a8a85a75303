"""Draft-length policies on synthetic acceptance and cost traces."""

from __future__ import annotations

import random

import pytest

from exactspec.costs import TRIAL_SHARE
from exactspec.policy import CostModelPolicy, FixedDraftLength, HeuristicDraftLength, TreePolicy, make_policy
from exactspec.verify import TreeVerdict, Verdict


def verdict(num_draft: int, accepted: int) -> Verdict:
    return Verdict(num_draft=num_draft, accepted=accepted, token=0)


def run_trace(policy, rounds: int, acceptance: float, score_seconds, draft_seconds_per_token: float = 0.0,
              seed: int = 0, log: list | None = None) -> list[int]:
    """Drive a policy with draft tokens each accepted with probability ``acceptance`` (independently, until the
    first rejection) and a target pass costing ``score_seconds(positions)``; the k it chose, round by round
    (``log``: where given, each round's (tokens emitted, seconds) appended to it)."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.next_k(16)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        seconds = draft_seconds_per_token * k + score_seconds(k + 1)
        policy.observe(verdict(k, accepted), draft_seconds_per_token * k, score_seconds(k + 1))
        chosen.append(k)
        if log is not None:
            log.append((accepted + 1, seconds))
    return chosen


def overhead(log: list[tuple[int, float]], plain_seconds: float) -> float:
    """The time the logged rounds took beyond plain decoding of the tokens they emitted, as a share of that."""
    tokens, seconds = sum(t for t, _ in log), sum(s for _, s in log)
    return seconds / (tokens * plain_seconds) - 1


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
    """Plain decoding, but for trial rounds, which cost at most the trial share of the time."""
    policy, log = CostModelPolicy(), []
    chosen = run_trace(policy, 400, acceptance=0.02, score_seconds=lambda n: 1 + 0.2 * (n - 1), log=log)
    late = chosen[200:]
    assert late.count(0) >= 0.8 * len(late)
    assert any(late) and 0 < overhead(log[200:], 1.0) <= 1.25 * TRIAL_SHARE


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
    # plain, but for trial rounds (a share of the time: cheap ones, one token each, come every few rounds)
    assert late.count(0) >= 0.75 * len(late) and policy.acceptances()[0] < 0.1
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


def learnt_policy(acceptance: float = 0.8, **settings) -> CostModelPolicy:
    """A policy that has watched 300 rounds of a drafter accepted at ``acceptance`` a token, drafting 0.1 s a
    token, and passes over n positions costing 1 + 0.05 (n - 1) s: drafting saves about half a second a token."""
    policy = CostModelPolicy(**settings)
    run_trace(policy, 300, acceptance, lambda n: 1 + 0.05 * (n - 1), draft_seconds_per_token=0.1)
    return policy


def test_a_backlog_the_tokens_left_do_not_repay_is_left_alone():
    """Issue 61: a draft model's prefill of the prompt was charged to no one, so -k auto paid it on long prompts
    where drafting could not win it back. Here drafting saves about 0.5 s a token; a draft model that would first
    catch up on a 700-token prompt at 0.1 s a token (70 s) repays that over some 140 tokens, not over 64 (plain
    decoding), over 400 (it drafts); a 40-token backlog (4 s) is repaid within 64."""
    policy = learnt_policy()
    policy.observe_catch_up(700, 70.0)
    assert policy.next_k(16) > 0 and policy.next_k(16, backlog=0, remaining=64) > 0  # current: drafting pays
    assert policy.next_k(16, backlog=700, remaining=64) == 0
    assert policy.next_k(16, backlog=700, remaining=400) > 0
    assert policy.next_k(16, backlog=40, remaining=64) > 0


def test_a_backlog_is_weighed_against_the_tokens_a_sequence_is_expected_to_emit_still():
    """A token limit only bounds a sequence: answers that end at their end token after a few tokens do not repay a
    catch-up that the limit would. Drafting saves about 0.5 s a token; a 40-token backlog costs 4 s. Where the
    sequences before ran to 64 tokens, a new one catches up at once; where most of them ended after 6, it does not
    (the median of them: 6 x 0.5 < 4), until it has outlived those (then the long ones, and its limit, bound it).
    (No trials: the plain rounds here are given.)"""
    policy = learnt_policy(trial_share=0.0)
    policy.observe_catch_up(700, 70.0)

    def sequences(length: int, count: int = 4) -> None:
        for _ in range(count):
            policy.observe_prefill(40, 4.0)
            for _ in range(length):
                policy.observe(verdict(0, 0), 0.0, 1.0)

    sequences(64)
    policy.observe_prefill(40, 4.0)
    assert policy.next_k(16, backlog=40, remaining=64) > 0
    sequences(6, count=12)  # 12 of the 16 kept
    policy.observe_prefill(40, 4.0)
    assert policy.next_k(16, backlog=40, remaining=64) == 0
    for _ in range(6):
        policy.observe(verdict(0, 0), 0.0, 1.0)
    assert policy.next_k(16, backlog=46, remaining=58) > 0


def test_until_catching_up_is_measured_the_targets_prefill_bounds_its_cost():
    """A new policy (priors: half the draft tokens accepted, drafting free) would draft at once; a long prompt's
    catching up, never measured yet, is taken to cost what the target's prefill of it cost (a draft model is not
    larger than its target), so a 700-token prompt that took the target 70 s (a pass: 1 s) is not caught up on for
    64 tokens; once a catch-up was measured cheap (0.01 s a token), it is. Before a pass is timed, a round's cost
    cannot be weighed against seconds of catching up: that round decodes plainly."""
    policy = CostModelPolicy()
    assert policy.next_k(16, backlog=700, remaining=64) > 0  # nothing measured: as optimistic as before
    policy = CostModelPolicy()
    policy.observe_prefill(700, 70.0)
    assert policy.next_k(16, backlog=700, remaining=64) == 0  # no pass timed yet
    policy.observe(verdict(0, 0), 0.0, 1.0)
    assert policy.next_k(16, backlog=700, remaining=64) == 0
    policy.observe_catch_up(700, 7.0)
    assert policy.next_k(16, backlog=700, remaining=64) > 0


def run_requests(policy, requests: int, prompt: int, new_tokens: int, acceptance: float, draft_seconds: float,
                 catch_up_seconds: float, prefill_seconds: float, seed: int = 0) -> tuple[float, float, int]:
    """Requests as the engine runs them: the target prefills ``prompt`` tokens (``prefill_seconds`` each), then
    rounds emit ``new_tokens``; a draft model catches up (``catch_up_seconds`` a token) on the tokens since it last
    drafted before a round that drafts, drafts ``draft_seconds`` a token, each accepted with probability
    ``acceptance``; a pass over n positions costs 1 + 0.1 (n - 1). Returns (seconds spent, seconds plain decoding
    would have taken, rounds that drafted)."""
    rng = random.Random(seed)
    spent = plain = 0.0
    drafting_rounds = 0
    for _ in range(requests):
        policy.observe_prefill(prompt, prompt * prefill_seconds)
        spent += prompt * prefill_seconds
        plain += prompt * prefill_seconds + new_tokens * 1.0
        context, drafted_at, lagging = prompt, 0, True
        while context < prompt + new_tokens:
            left = prompt + new_tokens - context
            backlog = max(context - 1 - drafted_at, 0) if lagging else 0
            k = policy.next_k(min(16, left - 1), backlog, left)
            if k:
                drafting_rounds += 1
                if backlog:
                    policy.observe_catch_up(backlog, backlog * catch_up_seconds)
                    spent += backlog * catch_up_seconds
                drafted_at = context
            lagging = k == 0
            accepted = 0
            while accepted < k and rng.random() < acceptance:
                accepted += 1
            score = 1 + 0.1 * k
            policy.observe(verdict(k, accepted), draft_seconds * k, score)
            spent += draft_seconds * k + score
            context += accepted + 1
    return spent, plain, drafting_rounds


def test_a_draft_model_that_does_not_pay_costs_at_most_the_trial_share():
    """The promise of -k auto: never much slower than plain decoding. A draft model accepted at 0.3, drafting at
    0.3 s a token (a pass costs 1 s) never pays; tried now and then, its trials (catching up on the prompt or on the
    rounds since it last drafted, included) cost at most the trial share of the time, prefills counted."""
    spent, plain, trials = run_requests(CostModelPolicy(), 60, prompt=200, new_tokens=64, acceptance=0.3,
                                        draft_seconds=0.3, catch_up_seconds=0.05, prefill_seconds=0.15)
    assert trials > 0 and spent <= plain * (1 + TRIAL_SHARE)


def test_a_draft_model_that_pays_drafts_from_the_first_request():
    """The other side: a draft model accepted at 0.8, drafting at 0.1 s a token and catching up at 0.02 s a token,
    is caught up on at the first request's prompt and drafts on: the requests take under 0.7 of plain decoding's
    time, prefills included."""
    spent, plain, _ = run_requests(CostModelPolicy(), 1, prompt=100, new_tokens=200, acceptance=0.8,
                                   draft_seconds=0.1, catch_up_seconds=0.02, prefill_seconds=0.05)
    assert spent < 0.7 * plain


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
    """No tree, but for trial rounds, which cost at most the trial share of the time (each a pass over its nodes
    that emits about one token)."""
    policy = TreePolicy()
    chosen = run_tree_trace(policy, 400, [0.01] * 8, lambda n: 1 + 0.2 * (n - 1))
    late = chosen[200:]
    assert sum(not w for w in late) >= 0.8 * len(late)
    trials = [w for w in late if w]
    assert trials and sum(0.2 * sum(w) for w in trials) <= 1.25 * TRIAL_SHARE * len(late)


def test_tree_policy_grows_a_deep_chain_where_first_choices_are_accepted_and_passes_are_cheap():
    chosen = run_tree_trace(TreePolicy(), 600, [0.9] + [0.05] * 7, lambda n: 1 + 0.02 * (n - 1))
    late = chosen[300:]
    assert sum(len(w) == 6 for w in late) >= 0.9 * len(late)  # its deepest tree, max_depth
    assert make_policy(4, "auto").name == "auto-tree"
