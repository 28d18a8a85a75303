"""The verifier alone: greedy edge cases, exact enumeration of the output distribution, and Monte Carlo."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from exactspec.sampling import SamplingParams, logits_to_probs
from exactspec.verify import (
    acceptance_probs,
    candidate_outcomes,
    residual_probs,
    verify,
    verify_choices,
    verify_tree,
    verify_tree_choices,
)

V = 6  # vocabulary of the enumeration tests

# each (target, draft) transform pair applies the same settings to both, as the engine does
SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.6),
]


def random_probs(generator: torch.Generator, *shape: int, params: SamplingParams) -> torch.Tensor:
    """Distributions [*shape, V] in float64, from random logits through the sampling transform."""
    logits = torch.randn(*shape, V, generator=generator, dtype=torch.float64) * 2
    return logits_to_probs(logits, params)


def first_token_distribution(p: torch.Tensor, q: torch.Tensor | None, draft_choice: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first emitted token of a one-token draft, enumerating the draft token.

    draft_choice [V] is how the drafter picks its token: q itself for a model drafter, any distribution for a
    point-mass drafter (verified as if q were a point mass on its choice).
    """
    out = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        if draft_choice[x] == 0:
            continue
        tokens = torch.tensor([x])
        a = acceptance_probs(tokens, None if q is None else q[None], torch.stack([p, p]))[0]
        out[x] += draft_choice[x] * a
        out += draft_choice[x] * (1 - a) * residual_probs(p, q, x)
    return out


@pytest.mark.parametrize("params", SETTINGS)
def test_one_step_output_is_exactly_the_target_distribution(params):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = random_probs(generator, params=params)
        q = random_probs(generator, params=params)
        assert torch.allclose(first_token_distribution(p, q, q), p, atol=1e-9, rtol=0)


@pytest.mark.parametrize("params", SETTINGS)
def test_point_mass_draft_is_exact_whatever_the_drafter_picks(params):
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = random_probs(generator, params=params)
        choice = torch.softmax(torch.randn(V, generator=generator, dtype=torch.float64) * 3, -1)
        assert torch.allclose(first_token_distribution(p, None, choice), p, atol=1e-9, rtol=0)
        deterministic = torch.zeros(V, dtype=torch.float64)
        deterministic[int(torch.randint(V, (1,), generator=generator))] = 1
        assert torch.allclose(first_token_distribution(p, None, deterministic), p, atol=1e-9, rtol=0)


@pytest.mark.parametrize("params", SETTINGS)
def test_two_token_chain_gives_the_exact_joint_of_three_tokens(params):
    """k = 2 with context-dependent distributions: the joint of the first three emitted tokens, completing a
    round that stops early with the target's own conditionals (the next round), equals p1 p2 p3."""
    generator = torch.Generator().manual_seed(2)
    p1 = random_probs(generator, params=params)  # [V]
    p2 = random_probs(generator, V, params=params)  # [V(x1), V]
    p3 = random_probs(generator, V, V, params=params)  # [V(x1), V(x2), V]
    q1 = random_probs(generator, params=params)
    q2 = random_probs(generator, V, params=params)
    expected = p1[:, None, None] * p2[:, :, None] * p3
    assert torch.allclose(chain_joint(p1, p2, p3, q1, q2), expected, atol=1e-9, rtol=0)


def chain_joint(p1: torch.Tensor, p2: torch.Tensor, p3: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor
                ) -> torch.Tensor:  # [V, V, V]
    """Exact joint of the first three tokens emitted by a round with a two-token draft drawn from q1 [V] and
    q2 [V(x1), V], against the target's p1 [V], p2 [V(x1), V], p3 [V(x1), V(x2), V], enumerating every draft; a
    round that stops early is completed with the target's own conditionals (the next rounds)."""
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for x1, x2 in itertools.product(range(V), repeat=2):
        weight = q1[x1] * q2[x1, x2]
        if weight == 0:
            continue
        draft = torch.tensor([x1, x2])
        target = torch.stack([p1, p2[x1], p3[x1, x2]])  # [k+1, V]
        a1, a2 = acceptance_probs(draft, torch.stack([q1, q2[x1]]), target).tolist()
        # rejected at 1: recovered y1, then the target's own next two tokens
        r1 = residual_probs(p1, q1, x1)  # [V]
        joint += weight * (1 - a1) * r1[:, None, None] * p2[:, :, None] * p3
        # accepted x1, rejected at 2: recovered y2, then the target's next token
        r2 = residual_probs(p2[x1], q2[x1], x2)
        joint[x1] += weight * a1 * (1 - a2) * r2[:, None] * p3[x1]
        # both accepted: the bonus token from p3 after (x1, x2)
        joint[x1, x2] += weight * a1 * a2 * p3[x1, x2]
    return joint


def test_monte_carlo_verify_matches_target_distribution():
    """verify() itself, sampled: the first and second emitted tokens follow p[0] and p[1].

    Chi-square goodness of fit at alpha = 0.001 for each of 4 tests: false-alarm rate about 0.4% for a
    correct verifier, before the seed is fixed (with the seed fixed the outcome is deterministic). With 8,000
    rounds per drafter, the first token's test catches with probability 0.99 a distribution at a chi-square
    distance of 0.005 from p[0] over the 6 tokens, so any that moves a total variation of 0.04 (the second
    token's, counted where a draft token was accepted, somewhat less; 20,000 rounds caught 0.002, 0.02).
    """
    generator = torch.Generator().manual_seed(3)
    k, n = 3, 8_000
    params = SamplingParams(temperature=1.0)
    p = random_probs(generator, k + 1, params=params)  # [k+1, V], the same whatever the draft
    q = random_probs(generator, k, params=params)  # [k, V]
    for draft_probs in (q, None):  # a model drafter, then a point-mass drafter choosing by q
        first = torch.zeros(V)
        second = torch.zeros(V)
        for _ in range(n):
            tokens = torch.multinomial(q, 1, generator=generator).squeeze(-1)  # [k]
            verdict = verify(tokens, draft_probs, p, generator)
            emitted = verdict.emitted(tokens.tolist())
            first[emitted[0]] += 1
            if len(emitted) > 1:
                second[emitted[1]] += 1
        assert chisquare(first, first.sum() * p[0]).pvalue > 1e-3
        assert chisquare(second, second.sum() * p[1]).pvalue > 1e-3


def test_monte_carlo_detects_a_biased_verifier():
    """The chi-square test has power: accepting every draft token (no rejection test) is caught."""
    generator = torch.Generator().manual_seed(4)
    p = random_probs(generator, params=SamplingParams(temperature=1.0))
    q = random_probs(generator, params=SamplingParams(temperature=1.0))
    drawn = torch.multinomial(q, 20_000, replacement=True, generator=generator)
    counts = torch.bincount(drawn, minlength=V).double()
    assert chisquare(counts, counts.sum() * p).pvalue < 1e-3


def test_same_seed_same_verdicts():
    p = logits_to_probs(torch.randn(5, 50, generator=torch.Generator().manual_seed(5)), SamplingParams(1.0))
    q = logits_to_probs(torch.randn(4, 50, generator=torch.Generator().manual_seed(6)), SamplingParams(1.0))
    tokens = torch.tensor([1, 2, 3, 4])
    runs = [
        [verify(tokens, q, p, generator) for _ in range(50)]
        for generator in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


# greedy edge cases ------------------------------------------------------------------------------------------


def test_greedy_all_accepted_gives_bonus():
    verdict = verify_choices(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6, 7]))
    assert (verdict.accepted, verdict.token, verdict.bonus) == (3, 7, True)
    assert verdict.emitted([4, 5, 6]) == [4, 5, 6, 7]


def test_greedy_first_rejected_gives_targets_token():
    verdict = verify_choices(torch.tensor([9, 5, 6]), torch.tensor([4, 5, 6, 7]))
    assert (verdict.accepted, verdict.token, verdict.bonus) == (0, 4, False)
    assert verdict.emitted([9, 5, 6]) == [4]


def test_greedy_rejection_in_the_middle_ignores_later_matches():
    verdict = verify_choices(torch.tensor([4, 9, 6]), torch.tensor([4, 5, 6, 7]))
    assert verdict.emitted([4, 9, 6]) == [4, 5]


def test_empty_draft_is_one_plain_step():
    assert verify_choices(torch.tensor([], dtype=torch.long), torch.tensor([3])).emitted([]) == [3]
    p = torch.tensor([[0.0, 1.0, 0.0]])
    verdict = verify(torch.tensor([], dtype=torch.long), None, p, torch.Generator().manual_seed(0))
    assert (verdict.accepted, verdict.token, verdict.bonus) == (0, 1, True)


def test_sampling_verifier_at_zero_temperature_is_greedy():
    """Greedy is the zero-temperature case of the same test: one-hot p and q give verify_choices's verdicts."""
    generator = torch.Generator().manual_seed(8)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(200):
        target_logits = torch.randn(5, 7, generator=generator)
        draft_logits = torch.randn(4, 7, generator=generator)
        tokens = draft_logits.argmax(-1)
        expected = verify_choices(tokens, target_logits.argmax(-1))
        as_sampling = verify(tokens, logits_to_probs(draft_logits, greedy), logits_to_probs(target_logits, greedy),
                             generator)
        as_point_mass = verify(tokens, None, logits_to_probs(target_logits, greedy), generator)
        assert as_sampling == expected == as_point_mass


# token trees ------------------------------------------------------------------------------------------------


def leaving_distribution(p: torch.Tensor, children: list[tuple[torch.Tensor | None, torch.Tensor]]) -> torch.Tensor:
    """Exact distribution [V] of the token that leaves one node, enumerating every draw of its children.

    ``children``: per child, (the q it is verified against, or None for a point mass; the distribution it is drawn
    from). Each child is drawn independently."""
    out = torch.zeros(V, dtype=torch.float64)
    for tokens in itertools.product(range(V), repeat=len(children)):
        weight = torch.prod(torch.stack([drawn[x] for x, (_, drawn) in zip(tokens, children)]))
        if weight == 0:
            continue
        chances, residual = candidate_outcomes(p, list(tokens), [q for q, _ in children])
        for x, chance in zip(tokens, chances[:-1]):
            out[x] += weight * chance
        out += weight * chances[-1] * residual
    return out


def one_hot(x: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(x), V).double()


@pytest.mark.parametrize("params", SETTINGS)
def test_several_candidates_leave_a_node_distributed_as_the_target(params):
    """Enumeration: i.i.d. draws from q (SpecInfer), fixed top-k point masses, and both mixed, all emit p."""
    generator = torch.Generator().manual_seed(20)
    for _ in range(5):
        p = random_probs(generator, params=params)
        q = random_probs(generator, params=params)
        top = torch.topk(q, 3).indices.tolist()
        cases = [
            [(q, q)] * 3,  # three independent draws from the drafter
            [(None, one_hot(x)) for x in top],  # its top three, each a point mass
            [(None, one_hot(top[0])), (q, q), (q, q)],  # a fixed first guess, then two draws
        ]
        for children in cases:
            assert torch.allclose(leaving_distribution(p, children), p, atol=1e-9, rtol=0)


def test_candidates_verified_against_the_wrong_q_are_caught():
    """The enumeration has power: children drawn from q but verified against another distribution are biased."""
    generator = torch.Generator().manual_seed(21)
    p, q, r = (random_probs(generator, params=SETTINGS[0]) for _ in range(3))
    assert not torch.allclose(leaving_distribution(p, [(r, q), (r, q)]), p, atol=1e-3)


def test_a_two_level_tree_gives_the_exact_joint_of_two_tokens():
    """Root with two children drawn from q1, each with two children drawn from q2(. | x1): the first two emitted
    tokens (a round that stops after one continues with the target's own p2) are jointly p1 p2."""
    generator = torch.Generator().manual_seed(22)
    params = SETTINGS[0]
    p1, q1 = random_probs(generator, params=params), random_probs(generator, params=params)
    p2, q2 = random_probs(generator, V, params=params), random_probs(generator, V, params=params)  # [V(x1), V]
    joint = torch.zeros(V, V, dtype=torch.float64)
    for pair in itertools.product(range(V), repeat=2):
        weight = q1[pair[0]] * q1[pair[1]]
        chances, residual = candidate_outcomes(p1, list(pair), [q1, q1])
        joint += weight * chances[-1] * residual[:, None] * p2  # recovered at the root, then the target's token
        for x1, chance in zip(pair, chances[:-1]):  # x1 accepted: its own two children decide the second token
            second = leaving_distribution(p2[x1], [(q2[x1], q2[x1])] * 2)
            joint[x1] += weight * chance * second
    assert torch.allclose(joint, p1[:, None] * p2, atol=1e-9, rtol=0)


def test_monte_carlo_tree_verifier_matches_the_target():
    """verify_tree itself, sampled, on a tree of three root children (two with a child of their own): the first
    and second emitted tokens follow p1 and sum_y p1(y) p2(. | y). Chi-square at alpha = 0.001 for each of 2 tests:
    false-alarm rate about 0.2% for a correct verifier, before the seed is fixed."""
    generator = torch.Generator().manual_seed(23)
    params = SETTINGS[0]
    p1, q1 = random_probs(generator, params=params), random_probs(generator, params=params)
    p2, q2 = random_probs(generator, V, params=params), random_probs(generator, V, params=params)
    p3 = random_probs(generator, V, V, params=params)
    parents = [-1, -1, -1, 0, 1]
    first, second = torch.zeros(V), torch.zeros(V)
    n = 5_000
    for _ in range(n):
        roots = torch.multinomial(q1, 3, replacement=True, generator=generator).tolist()
        grandchildren = [int(torch.multinomial(q2[x], 1, generator=generator)) for x in roots[:2]]
        tokens = roots + grandchildren
        draft_probs = torch.stack([q1, q1, q1, q2[roots[0]], q2[roots[1]]])
        target = torch.stack([p1, p2[roots[0]], p2[roots[1]], p2[roots[2]], p3[roots[0], tokens[3]],
                              p3[roots[1], tokens[4]]])
        emitted = verify_tree(tokens, parents, draft_probs, target, generator).emitted(tokens)
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=generator)))
        first[emitted[0]] += 1
        second[emitted[1]] += 1
    assert chisquare(first, n * p1).pvalue > 1e-3
    assert chisquare(second, n * (p1[:, None] * p2).sum(0)).pvalue > 1e-3


def test_greedy_tree_descends_the_targets_argmax():
    #        root
    #   5 (0)    7 (1)
    #   |        |    \
    #   6 (2)    8 (3) 9 (4)
    tokens, parents = [5, 7, 6, 8, 9], [-1, -1, 0, 1, 1]
    argmax = [7, 6, 2, 1, 4, 3]  # after root: 7 -> node 1; after node 1: 2, no child is 2
    verdict = verify_tree_choices(tokens, parents, argmax)
    assert (verdict.path, verdict.token, verdict.emitted(tokens)) == ([1], 2, [7, 2])
    argmax[2] = 9  # after node 1: 9 -> node 4, a leaf: its argmax is the bonus
    assert verify_tree_choices(tokens, parents, argmax).emitted(tokens) == [7, 9, 3]
    assert verify_tree_choices(tokens, parents, [1, 0, 0, 0, 0, 0]).emitted(tokens) == [1]


def test_the_sampling_tree_verifier_at_zero_temperature_is_greedy():
    generator = torch.Generator().manual_seed(24)
    greedy = SamplingParams(temperature=0.0)
    tokens, parents = [0, 1, 2, 3, 4], [-1, -1, 0, 0, 1]
    for _ in range(100):
        logits = torch.randn(6, V, generator=generator)
        expected = verify_tree_choices(tokens, parents, logits.argmax(-1).tolist())
        assert verify_tree(tokens, parents, None, logits_to_probs(logits, greedy), generator) == expected
