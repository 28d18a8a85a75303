"""The engine end to end on tiny random models: greedy identity, exact sampling, rollback, stopping."""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare
from tiny import E2E_PROMPT, e2e_models, e2e_samples, perturbed_copy, tiny_llama

from exactspec.backends import HFCausalLM, LeanRuntime
from exactspec.backends.base import CHAIN_LEAD, sync
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.policy import Policy
from exactspec.proposers import DraftModelProposer, NoProposer, PromptLookupProposer, RetrievalProposer
from exactspec.sampling import SamplingParams, logits_to_probs

PROMPTS = [[5, 9, 12, 9, 12, 40], [3, 3, 3, 3], [60, 2, 17, 33, 8, 17, 33, 21, 9], [7]]


@pytest.fixture(scope="module")
def target_and_draft():
    # float64 keeps the tiny models' logits free of rounding near-ties, so greedy identity is exact
    target = tiny_llama(seed=0, init_range=0.5).double()
    return target, perturbed_copy(target, noise=0.03, seed=1).double()


def greedy(engine: Engine, prompt: list[int], k: int, n: int = 24) -> list[int]:
    config = GenerationConfig(max_new_tokens=n, num_draft_tokens=k, stop_at_eos=False)
    return engine.generate(prompt, config).token_ids


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with no cache at all: the full sequence re-scored at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


BACKENDS = [HFCausalLM, LeanRuntime]


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize("k", [1, 3, 8, "auto", "heuristic"])
def test_greedy_speculation_is_token_for_token_plain_greedy(target_and_draft, k, backend_class):
    target, draft = target_and_draft
    target_backend = backend_class(target)
    engines = {
        "none": Engine(target_backend, NoProposer()),
        "prompt-lookup": Engine(target_backend, PromptLookupProposer()),
        "retrieval": Engine(target_backend, RetrievalProposer(min_order=1)),
        "draft-model": Engine(target_backend, DraftModelProposer(backend_class(draft), target_backend.vocab_size)),
    }
    for prompt in PROMPTS:
        expected = reference_greedy(target, prompt, 24)
        for name, engine in engines.items():
            assert greedy(engine, prompt, k) == expected, (name, prompt)


@pytest.mark.parametrize("tree", [(1,), (3,), (3, 2, 1)])
def test_greedy_tree_speculation_from_copies_is_plain_greedy(target_and_draft, tree):
    """Prompt lookup's and retrieval's several continuations, and the draft model's ranked alternatives, as trees
    scored in one pass of the lean runtime."""
    target, draft = target_and_draft
    target_backend = LeanRuntime(target)
    engines = {
        "prompt-lookup": Engine(target_backend, PromptLookupProposer(min_ngram=1)),
        "retrieval": Engine(target_backend, RetrievalProposer(min_order=1)),
        "draft-model": Engine(target_backend, DraftModelProposer(LeanRuntime(draft), target_backend.vocab_size)),
    }
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, stop_at_eos=False, tree=tree)
    branched = 0
    for prompt in PROMPTS:
        expected = reference_greedy(target, prompt, 24)
        for name, engine in engines.items():
            result = engine.generate(prompt, config)
            assert result.token_ids == expected, (name, prompt, tree)
            if tree != (1,):
                branched += sum(_branches(engine.proposer.propose_tree(prompt + expected[:i], config.tree_widths(3),
                                                                       config.sampling, None))
                                for i in range(0, 24, 4))
    assert branched > 0 or tree == (1,)  # some drafts really were trees


def test_greedy_speculation_with_trees_of_auto_shape_is_plain_greedy(target_and_draft):
    """``tree="auto"``: the tree policy chooses each round's shape; the output stays the target's greedy output,
    and the shapes it chose were trees (more nodes scored than depth drafted) in some rounds."""
    target, draft = target_and_draft
    target_backend = LeanRuntime(target)
    engine = Engine(target_backend, DraftModelProposer(LeanRuntime(draft), target_backend.vocab_size))
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens="auto", stop_at_eos=False, tree="auto")
    nodes = depth = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, config)
        assert result.token_ids == reference_greedy(target, prompt, 24), prompt
        assert result.stats.policy == "auto-tree"
        nodes, depth = nodes + result.stats.draft_nodes, depth + result.stats.draft_tokens
    assert nodes > depth > 0


SEEDED = SamplingParams(temperature=0.7, top_p=0.95)  # the invariant sampler, by default


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_seeded_speculation_samples_plain_sampling_tokens(target_and_draft, k, backend_class):
    """At temperature 0.7 (top-p 0.95), a seed gives the same tokens with every drafter as without one: the
    invariant sampler's choices depend on the seed and the position alone. Drafts are accepted and rejected."""
    target, draft = target_and_draft
    target_backend = backend_class(target)
    plain = Engine(target_backend, NoProposer())
    engines = {
        "prompt-lookup": Engine(target_backend, PromptLookupProposer()),
        "retrieval": Engine(target_backend, RetrievalProposer(min_order=1)),
        "draft-model": Engine(target_backend, DraftModelProposer(backend_class(draft), target_backend.vocab_size)),
    }
    accepted = rejected = 0
    for seed, prompt in enumerate(PROMPTS):
        config = GenerationConfig(max_new_tokens=24, sampling=SEEDED, seed=seed, stop_at_eos=False)
        expected = plain.generate(prompt, config).token_ids
        for name, engine in engines.items():
            stats = engine.generate(prompt, replace(config, num_draft_tokens=k))
            assert stats.token_ids == expected, (name, prompt)
            accepted += stats.stats.accepted_tokens
            rejected += stats.stats.draft_tokens - stats.stats.accepted_tokens
    assert accepted > 0 and rejected > 0


@pytest.mark.parametrize("tree", [(3, 2, 1), "auto"])
def test_seeded_tree_speculation_samples_plain_sampling_tokens(target_and_draft, tree):
    """Trees too: a node is accepted when its token is the target's own choice at its depth's position."""
    target, draft = target_and_draft
    target_backend = LeanRuntime(target)
    plain = Engine(target_backend, NoProposer())
    engines = [Engine(target_backend, PromptLookupProposer(min_ngram=1)),
               Engine(target_backend, DraftModelProposer(LeanRuntime(draft), target_backend.vocab_size))]
    nodes = depth = 0
    for seed, prompt in enumerate(PROMPTS):
        config = GenerationConfig(max_new_tokens=24, sampling=SEEDED, seed=seed, stop_at_eos=False)
        expected = plain.generate(prompt, config).token_ids
        for engine in engines:
            result = engine.generate(prompt, replace(config, num_draft_tokens=3, tree=tree))
            assert result.token_ids == expected, (engine.proposer.name, prompt)
            nodes, depth = nodes + result.stats.draft_nodes, depth + result.stats.draft_tokens
    assert nodes > depth > 0  # the drafts were trees


def test_the_standard_rule_keeps_its_own_draws(target_and_draft):
    """``method="standard"``: the rejection rule with one random stream, reproducible for a seed (its tokens depend
    on the drafts, so they are compared with the same drafter's)."""
    target, draft = target_and_draft
    backend = LeanRuntime(target)
    engine = Engine(backend, DraftModelProposer(LeanRuntime(draft), backend.vocab_size))
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, sampling=replace(SEEDED, method="standard"),
                              seed=4, stop_at_eos=False)
    first = engine.generate(PROMPTS[0], config)
    assert engine.generate(PROMPTS[0], config).token_ids == first.token_ids
    assert 0 < first.stats.accepted_tokens < first.stats.draft_tokens


def _branches(draft) -> bool:
    """Whether a draft tree has a node (or root) with more than one child."""
    return draft.parents is not None and len(draft.parents) > len(set(draft.parents))


def test_speculation_actually_accepts_and_rejects(target_and_draft):
    """The identity above must not hold vacuously: drafts are both accepted and rejected."""
    target, draft = target_and_draft
    backend = HFCausalLM(target)
    engine = Engine(backend, DraftModelProposer(HFCausalLM(draft), backend.vocab_size))
    stats = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=64, num_draft_tokens=4,
                                                         stop_at_eos=False)).stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.rounds < stats.new_tokens == 64


def test_draft_model_with_narrower_logits_is_padded():
    """A draft whose logits are narrower than the target's (padded vocabularies differ) still verifies."""
    target = tiny_llama(seed=0, vocab_size=64, init_range=0.5).double()
    draft = tiny_llama(seed=2, vocab_size=60, init_range=0.5).double()
    backend = HFCausalLM(target)
    engine = Engine(backend, DraftModelProposer(HFCausalLM(draft), backend.vocab_size))
    assert greedy(engine, PROMPTS[0], 3) == reference_greedy(target, PROMPTS[0], 24)
    sampled = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16, sampling=SamplingParams(1.0), seed=0))
    assert len(sampled.token_ids) > 0
    with pytest.raises(UsageError, match="wider"):
        DraftModelProposer(HFCausalLM(target), target_vocab_size=60)


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_rollback_then_extend_equals_a_fresh_forward(backend_class):
    model = tiny_llama(seed=3).double()
    backend = backend_class(model)
    backend.extend([1, 2, 3, 4, 5], 0)
    backend.extend([6, 7, 8], 3)
    backend.rollback(6)  # keep [1..6]
    logits = backend.extend([9, 10], 2)
    with torch.no_grad():
        fresh = model(torch.tensor([[1, 2, 3, 4, 5, 6, 9, 10]])).logits[0, -2:]
    assert backend.tokens == [1, 2, 3, 4, 5, 6, 9, 10]
    assert torch.allclose(logits, fresh, atol=1e-10)


def test_sync_reuses_the_shared_prefix():
    backend = HFCausalLM(tiny_llama(seed=3).double())
    sync(backend, [1, 2, 3, 4], 0)
    calls = []
    original = backend.extend
    backend.extend = lambda ids, n: calls.append(list(ids)) or original(ids, n)
    sync(backend, [1, 2, 3, 7, 8], 1)
    assert calls == [[7, 8]]
    sync(backend, [1, 2, 3, 7, 8], 1)  # all cached: the last token is re-fed for its logits
    assert calls[-1] == [8]


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_engines_sharing_one_backend_see_its_true_cache(target_and_draft, backend_class):
    """The backend, not the engine, knows what its cache holds: two engines taking turns on one target get
    the same answers as each alone."""
    target, draft = target_and_draft
    backend = backend_class(target)
    first = Engine(backend, NoProposer())
    second = Engine(backend, DraftModelProposer(backend_class(draft), backend.vocab_size))
    alone = greedy(first, PROMPTS[0], 4)
    greedy(second, PROMPTS[0][:2] + [7, 7], 4)  # shares two tokens with PROMPTS[0], then overwrites the cache
    assert greedy(first, PROMPTS[0], 4) == alone == reference_greedy(target, PROMPTS[0], 24)


def test_same_seed_same_sample_and_seeds_differ(target_and_draft):
    target, draft = target_and_draft
    backend = HFCausalLM(target)
    engine = Engine(backend, DraftModelProposer(HFCausalLM(draft), backend.vocab_size))

    def sample(seed):
        config = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(1.0), seed=seed, stop_at_eos=False)
        return engine.generate(PROMPTS[0], config).token_ids

    assert sample(11) == sample(11)
    assert len({tuple(sample(seed)) for seed in range(5)}) > 1


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_stops_at_eos_and_at_the_token_limit(target_and_draft, backend_class):
    target, draft = target_and_draft
    backend = backend_class(target)
    free = greedy(Engine(backend, NoProposer()), PROMPTS[0], 4, n=24)
    eos = free[10]
    cut_at = free.index(eos) + 1
    for proposer in (NoProposer(), DraftModelProposer(backend_class(draft), backend.vocab_size)):
        engine = Engine(backend, proposer, eos_token_ids={eos})
        out = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, num_draft_tokens=4))
        assert out.token_ids == free[:cut_at]
        limited = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=3, num_draft_tokens=8,
                                                               stop_at_eos=False))
        assert limited.token_ids == free[:3] and limited.stats.new_tokens == 3


def test_stats_count_rounds_and_kinds(target_and_draft):
    target, draft = target_and_draft
    backend = HFCausalLM(target)
    engine = Engine(backend, DraftModelProposer(HFCausalLM(draft), backend.vocab_size))
    out = engine.generate(PROMPTS[2], GenerationConfig(max_new_tokens=40, num_draft_tokens=3, stop_at_eos=False))
    kinds = Counter(out.kinds)
    assert kinds["accepted"] == out.stats.accepted_tokens
    assert kinds["recovered"] + kinds["bonus"] == out.stats.rounds
    assert out.stats.mean_accepted_length == pytest.approx(40 / out.stats.rounds)
    assert out.stats.to_dict()["acceptance_rate"] == pytest.approx(kinds["accepted"] / out.stats.draft_tokens)
    plain = Engine(backend, NoProposer()).generate(PROMPTS[2], GenerationConfig(max_new_tokens=5))
    assert plain.kinds == ["plain"] * len(plain.token_ids) and plain.stats.draft_tokens == 0


def test_acceptance_by_draft_position_counts_each_round():
    from exactspec.engine import GenerationStats
    from exactspec.step import Round

    stats = GenerationStats()
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (0, 0)):
        stats.record(Round(draft_tokens=drafted, accepted=accepted, tokens=[7] * (accepted + 1), kinds=[]))
    assert stats.drafted_at == [3, 3, 2] and stats.accepted_at == [2, 1, 1]
    assert stats.acceptance_by_position == [2 / 3, 1 / 3, 1 / 2]
    assert stats.accepted_tokens == 3 + 1 + 0 and stats.draft_tokens == 3 + 3 + 2  # the rounds' own totals


def test_prompt_longer_than_the_model_is_refused():
    engine = Engine(HFCausalLM(tiny_llama(seed=0)), NoProposer())
    with pytest.raises(UsageError, match="at most"):
        engine.generate(list(range(3, 60)) * 10, GenerationConfig(max_new_tokens=2))


# exact sampling, end to end ---------------------------------------------------------------------------------

E2E_SAMPLING = {"temperature": 0.9, "top_p": 0.95}
# Samples per arm. Each chi-square test below runs at alpha = 0.001 over the outcomes expected at least 5 times
# (about 90 bins for E2E_PROMPT, 200 for REPEATING_PROMPT, plus one for the rest): with 8,000 samples it catches,
# with probability 0.99, any sampler whose binned distribution lies at a chi-square distance sum((q-p)^2/p) of
# 0.013 (E2E_PROMPT) or 0.018 (REPEATING_PROMPT) from the exact one, so any that moves a total variation of 0.06
# (0.07) of the mass; a sampler that takes the draft's distribution lies at 0.4 here. (20,000 samples caught 0.006,
# at two and a half times the time.)
E2E_SAMPLES = 8_000


def exact_joint_of_first_three(sampling: SamplingParams, prompt: list[int] = E2E_PROMPT, target=None
                               ) -> dict[tuple[int, int, int], float]:
    """P(y1, y2, y3) under plain sampling from the tiny target (the end-to-end one unless given), by enumerating
    every two-token prefix."""
    target = target if target is not None else e2e_models()[0]
    vocab = target.config.vocab_size
    y1, y2 = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    prompts = torch.tensor(prompt).expand(vocab * vocab, -1)
    batch = torch.cat([prompts, y1.reshape(-1, 1), y2.reshape(-1, 1)], dim=1)  # [V*V, len+2]
    with torch.no_grad():
        logits = target(batch).logits[:, -3:].double()  # [V*V, 3, V]
    probs = logits_to_probs(logits, sampling)
    p1 = probs[0, 0]  # [V]
    p2 = probs[::vocab, 1]  # [V(y1), V]
    p3 = probs[:, 2].reshape(vocab, vocab, vocab)  # [V(y1), V(y2), V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return {tuple(idx): float(joint[tuple(idx)]) for idx in torch.nonzero(joint > 0).tolist()}


def bin_counts(samples: list[tuple[int, ...]], bins: list[tuple]) -> np.ndarray:
    counts = Counter(samples)
    binned = [counts.get(b, 0) for b in bins]
    return np.array(binned + [len(samples) - sum(binned)], dtype=float)  # last bin: everything else


@pytest.mark.slow  # over 10 s on 2 cores
@pytest.mark.parametrize("method", ["invariant", "standard"])
def test_speculative_sampling_matches_plain_sampling_end_to_end(method):
    """The first three tokens of speculative sampling (draft model, k=2, temperature 0.9, top-p 0.95) have the
    joint distribution of plain sampling, under each sampling method.

    8,000 samples per arm (E2E_SAMPLES says what they detect). Bins: every 3-token outcome expected at least 5
    times, plus one bin for the rest.
    Standard: three chi-square tests at alpha = 0.001 each (speculative vs exact, plain vs exact, speculative vs
    plain): a correct engine fails one with probability under 0.3%. Invariant: plain sampling gives the very tokens
    speculation gives for each seed (checked on 500 seeds), so one test, speculative vs exact, at alpha = 0.001.
    The seeds are fixed, so the outcome is repeatable.
    """
    sampling = SamplingParams(**E2E_SAMPLING, method=method)
    exact = exact_joint_of_first_three(sampling)
    bins = [outcome for outcome, p in exact.items() if p * E2E_SAMPLES >= 5]
    expected = np.array([exact[b] for b in bins] + [1 - sum(exact[b] for b in bins)]) * E2E_SAMPLES
    assert len(bins) > 80 and expected[-1] < 0.05 * E2E_SAMPLES  # the bins hold most of the mass

    half = E2E_SAMPLES // 2
    arms = {"draft-model": [(0, half), (half, half)]}
    arms["none"] = [(0, 500)] if method == "invariant" else [(10**6, half), (10**6 + half, half)]
    jobs = [(drafter, seed, n) for drafter, runs in arms.items() for seed, n in runs]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(e2e_samples, [(d, {**E2E_SAMPLING, "method": method}, n, seed) for d, seed, n in jobs])
    speculative = bin_counts(results[0] + results[1], bins)
    assert chisquare(speculative, expected).pvalue > 1e-3
    if method == "invariant":
        assert results[2] == results[0][:500]
        return
    plain = bin_counts(results[2] + results[3], bins)
    assert chisquare(plain, expected).pvalue > 1e-3
    seen = (speculative + plain) > 0  # a bin neither arm hit carries no information on their difference
    assert chi2_contingency(np.stack([speculative[seen], plain[seen]])).pvalue > 1e-3


# a prompt that repeats itself, so that retrieval drafts its continuation in most rounds
REPEATING_PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]


@pytest.mark.slow  # over 10 s on 2 cores
def test_retrieval_with_an_adaptive_draft_length_samples_exactly():
    """The first three tokens under retrieval drafting (point-mass drafts) with ``--num-draft-tokens auto`` have the
    joint distribution of plain sampling: 8,000 samples against the exact joint, one chi-square test at
    alpha = 0.001 (a correct engine fails it with probability 0.1%; the seeds are fixed; E2E_SAMPLES says what
    it detects)."""
    sampling = SamplingParams(**E2E_SAMPLING)
    exact = exact_joint_of_first_three(sampling, REPEATING_PROMPT)
    bins = [outcome for outcome, p in exact.items() if p * E2E_SAMPLES >= 5]
    expected = np.array([exact[b] for b in bins] + [1 - sum(exact[b] for b in bins)]) * E2E_SAMPLES
    half = E2E_SAMPLES // 2
    jobs = [(0, half), (half, half)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(e2e_samples, [("retrieval", E2E_SAMPLING, n, seed, tuple(REPEATING_PROMPT), "auto")
                                             for seed, n in jobs])
    observed = bin_counts(results[0] + results[1], bins)
    assert len(bins) > 150 and expected[-1] < 0.2 * E2E_SAMPLES
    assert chisquare(observed, expected).pvalue > 1e-3
    # and retrieval really drafted, with both outcomes: the exactness above covers accepted and rejected drafts
    # (its copies are accepted a few percent of the time on this random model: 400 seeds find some)
    target, _ = e2e_models()
    engine = Engine(LeanRuntime(target), RetrievalProposer())
    stats = [engine.generate(REPEATING_PROMPT, GenerationConfig(max_new_tokens=3, num_draft_tokens=2,
                                                                sampling=sampling, seed=s, stop_at_eos=False)).stats
             for s in range(400)]
    assert 0 < sum(st.accepted_tokens for st in stats) < sum(st.draft_tokens for st in stats)


@pytest.mark.parametrize("backend_class", [LeanRuntime])
def test_bfloat16_speculation_is_plain_bfloat16_greedy(backend_class):
    """In bfloat16 too, where one rounding moves a logit by up to 2^-8 of it: the runtime computes each position as
    it does alone, so speculation gives plain decoding's tokens bit for bit."""
    target = tiny_llama(seed=0, init_range=0.5)
    draft = perturbed_copy(target, noise=0.03, seed=1).to(torch.bfloat16)
    target = target.to(torch.bfloat16)
    backend = backend_class(target)
    plain = Engine(backend, NoProposer())
    speculative = Engine(backend, DraftModelProposer(backend_class(draft), backend.vocab_size))
    for prompt in PROMPTS:
        assert greedy(speculative, prompt, 4) == greedy(plain, prompt, 4), prompt


def test_capabilities_are_declared_and_a_missing_one_is_refused_by_name():
    """Trees, hidden states and shallow runs are capabilities a backend declares; a drafter or a tree that needs
    one its backend lacks is refused in one line naming it."""
    from exactspec.backends.base import FeatureSource, ShallowRunner, TreeScorer, declares
    from exactspec.errors import UsageError
    from exactspec.proposers import make_proposer

    model = tiny_llama(seed=0)
    lean, plain = LeanRuntime(model), HFCausalLM(model)
    assert all(declares(lean, c) for c in (TreeScorer, FeatureSource, ShallowRunner))
    assert not any(declares(plain, c) for c in (TreeScorer, FeatureSource, ShallowRunner))
    with pytest.raises(UsageError, match="TreeScorer"):
        Engine(plain, PromptLookupProposer()).check_tree((2, 1))
    Engine(lean, PromptLookupProposer()).check_tree((2, 1))
    with pytest.raises(UsageError, match="chains only"):
        Engine(lean, NoProposer()).check_tree((2, 1))
    for drafter, capability in (("eagle", "FeatureSource"), ("mtp", "FeatureSource"), ("early-exit", "ShallowRunner")):
        with pytest.raises(UsageError, match=capability):
            make_proposer(drafter, plain, object())


class _Scripted(Policy):
    """A policy that drafts the lengths it is given, in turn, and keeps what each round cost the drafter, and each
    backlog it was told of and caught up on."""

    name = "scripted"

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.draft_seconds = list(lengths), []
        self.backlogs: list[int] = []  # the backlog each next_k was told of
        self.caught_up: list[tuple[int, float]] = []  # (tokens, seconds) of each catch-up

    def next_k(self, max_k: int, backlog: int = 0, remaining: int | None = None) -> int:
        self.backlogs.append(backlog)
        return min(self.lengths.pop(0) if self.lengths else 2, max_k)

    def observe(self, verdict, draft_seconds: float, target_seconds: float) -> None:
        self.draft_seconds.append(draft_seconds)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self.caught_up.append((tokens, seconds))

    def tree_widths(self, depth: int) -> list[int]:
        return [1] * depth


def test_a_draft_models_backlog_is_taken_in_apart_from_what_drafting_costs(target_and_draft):
    """The prompt, and the tokens of rounds that drafted nothing, reach the draft model before the timed proposal
    (catch_up), all but the last CHAIN_LEAD, which the draft's first pass feeds: the policy learns the cost of
    drafting k tokens, not of a backlog; the tokens stay plain greedy's."""
    target, draft = target_and_draft
    caught_up: list[int] = []

    class Slow(DraftModelProposer):
        def catch_up(self, context):
            caught_up.append(len(context))
            time.sleep(0.3)  # a backlog far dearer than any proposal of these tiny models
            super().catch_up(context)

    prompt, plain = PROMPTS[2] * 2, CHAIN_LEAD + 2  # a backlog of more than a lead: the prompt, the plain rounds
    engine = Engine(LeanRuntime(target), Slow(LeanRuntime(draft), target.config.vocab_size))
    policy = _Scripted([2] + [0] * plain + [2, 2])
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    rounds = list(engine.rounds(prompt, config, policy))
    tokens = [t for round_ in rounds for t in round_.tokens]
    assert tokens == reference_greedy(target, prompt, 24)
    after_plain = len(prompt) + sum(len(r.tokens) for r in rounds[: plain + 1])
    assert caught_up == [len(prompt), after_plain]  # the first round's and the one after the plain ones
    assert max(policy.draft_seconds) < 0.3
    # the policy is told each backlog before choosing (the prompt but its lead; none after a drafting round), and
    # what each catch-up cost, apart from drafting
    assert policy.backlogs[:2] == [len(prompt) - CHAIN_LEAD, 0]
    # all since it drafted but the lead, less the draft tokens it fed itself that were accepted (it feeds each of
    # its drafted tokens but the last to draft the next)
    fed_and_accepted = min(rounds[0].accepted, rounds[0].draft_tokens - 1)
    assert policy.backlogs[plain + 1] == after_plain - CHAIN_LEAD - len(prompt) - fed_and_accepted
    assert [tokens for tokens, _ in policy.caught_up] == [policy.backlogs[0], policy.backlogs[plain + 1]]
    assert min(seconds for _, seconds in policy.caught_up) >= 0.3
