"""A draft vocabulary: counting a tokenizer's ids on the shipped corpus, choosing the ids and their number, and the
exact rules with a draft whose distribution q is 0 outside it (greedy, the invariant sampler, the standard rule),
where the target's mass lies partly outside it too."""

from __future__ import annotations

import fnmatch
import gzip
import importlib.util
import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from scipy.stats import chisquare
from test_verify import SETTINGS, V, chain_joint, first_token_distribution, leaving_distribution

from exactspec import draft_vocabulary as dv
from exactspec.draft_vocabulary import CorpusCounts, DraftVocabulary, token_counts
from exactspec.drafters.networks import DraftVocab
from exactspec.proposers.base import Draft
from exactspec.sampling import SamplingParams, invariant_choice, logits_to_probs
from exactspec.step import verify_draft
from exactspec.verify import acceptance_probs, verify, verify_choices

ROOT = Path(__file__).resolve().parent.parent


class CharTokenizer:
    """A tokenizer whose ids are characters' code points (mod ``size``): what ``token_counts`` is asked to count is
    plain to see. It refuses to add tokens, as the counting must not ask it to."""

    def __init__(self, size: int = 128) -> None:
        self.size = size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(char) % self.size for char in text]


def counts_of(fit: list[int], heldout: list[int]) -> CorpusCounts:
    return CorpusCounts(np.array(fit, dtype=np.int64), np.array(heldout, dtype=np.int64))


# counting ------------------------------------------------------------------------------------------------------


def test_each_text_is_counted_alone_without_added_tokens():
    counts = token_counts(CharTokenizer(), 128, ["abca", "", "a"])
    assert counts.dtype == np.int64 and counts.shape == (128,)
    assert (counts[ord("a")], counts[ord("b")], counts[ord("c")], counts.sum()) == (3, 1, 1, 5)


def test_ids_past_the_logits_width_are_not_counted():
    assert token_counts(CharTokenizer(), 99, ["abc"]).tolist() == [0] * 97 + [1, 1]  # 'a' = 97, 'b' = 98, 'c' = 99


def test_the_fit_part_is_the_first_80_percent_of_conversations_and_the_rest_is_held_out():
    conversations = [["a"], ["b", "b"], ["c"], ["d"], ["e", "ee"]]
    counts = CorpusCounts.of(CharTokenizer(), 128, conversations)
    assert [int(counts.fit[ord(c)]) for c in "abcde"] == [1, 2, 1, 1, 0]
    assert counts.heldout.sum() == counts.heldout[ord("e")] == 3


def test_the_shipped_corpus_is_package_data_with_code_and_no_benchmark_prompt():
    conversations = dv.corpus_conversations()
    text = "\n".join(turn for turns in conversations for turn in turns)
    assert len(conversations) == 490 and 2_400_000 < len(text.encode("utf-8")) < 3_000_000
    assert text.count("```python") >= 100  # code beside prose
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    relative = dv.CORPUS_PATH.relative_to(ROOT / "exactspec" / "drafters").as_posix()
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns["exactspec.drafters"])
    make = _corpus_maker()
    prompts = make.benchmark_prompts()
    assert len(prompts) > 700
    assert not any(prompt in text for prompt in prompts if len(prompt) >= make.CONTAINED_CHARS)


def test_the_corpus_maker_leaves_out_a_conversation_that_asks_a_benchmark_prompt():
    make = _corpus_maker()
    humaneval = json.loads(gzip.open(ROOT / "data" / "HumanEval.jsonl.gz", "rt").readline())["prompt"]
    mt_bench = json.loads((ROOT / "data" / "mt_bench_question.jsonl").open().readline())["turns"][1]
    prompts = make.benchmark_prompts()
    long_prompts = [prompt for prompt in prompts if len(prompt) >= make.CONTAINED_CHARS]

    def asks(text: str) -> bool:
        turns = [{"from": "human", "value": text}, {"from": "gpt", "value": "An answer."}]
        return make.is_benchmark(turns, prompts, long_prompts)

    assert asks(mt_bench) and asks("  " + mt_bench.replace(" ", "\n ") + "\n")  # equal, whitespace aside
    assert asks("Please finish this:\n" + humaneval)  # a long prompt inside a turn
    assert not asks("Write a haiku about speculative decoding.")
    assert not make.is_benchmark([{"from": "gpt", "value": humaneval}], prompts, long_prompts)  # users' turns only


def _corpus_maker():
    path = dv.CORPUS_PATH.with_name("make.py")
    spec = importlib.util.spec_from_file_location("corpus_make", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# choosing ------------------------------------------------------------------------------------------------------


def test_ids_are_ranked_by_count_ties_by_id_and_controls_are_always_kept():
    counts = counts_of(fit=[5, 0, 7, 5, 9, 1, 5, 0], heldout=[1, 1, 1, 1, 1, 1, 1, 1])
    chosen = DraftVocabulary.of_size(counts, controls=[7], size=4)
    # the control 7; then counts 9 (id 4) and 7 (id 2); of the three 5s (ids 0, 3, 6), the lowest id
    assert chosen.ids.dtype == np.int32 and chosen.ids.tolist() == [0, 2, 4, 7]
    assert chosen.size == 4 and chosen.coverage == pytest.approx(4 / 8)
    assert DraftVocabulary.of_size(counts, controls=[7], size=5).ids.tolist() == [0, 2, 3, 4, 7]


def test_the_size_chosen_is_the_smallest_step_whose_held_out_coverage_reaches_the_target():
    rng = np.random.default_rng(0)
    vocab = 10_000
    weights = 1.0 / np.arange(1, vocab + 1) ** 1.1  # Zipf-like, in a shuffled id order
    order = rng.permutation(vocab)
    fit, heldout = np.zeros(vocab, np.int64), np.zeros(vocab, np.int64)
    fit[order] = rng.multinomial(400_000, weights / weights.sum())
    heldout[order] = rng.multinomial(100_000, weights / weights.sum())
    counts, controls = CorpusCounts(fit, heldout), [0, 1, 2]
    curve = [DraftVocabulary.of_size(counts, controls, size).coverage for size in range(1, vocab + 1, 97)]
    assert all(a <= b for a, b in zip(curve, curve[1:]))  # coverage never falls as ids are added
    sizes = []
    for target in (0.5, 0.8, 0.9, 0.95):
        chosen = DraftVocabulary.choose(counts, controls, target=target, step=512)
        assert chosen.size % 512 == 0 and chosen.coverage >= target
        if chosen.size > 512:  # the step below falls short
            assert DraftVocabulary.of_size(counts, controls, chosen.size - 512).coverage < target
        sizes.append(chosen.size)
        assert {0, 1, 2} <= set(chosen.ids.tolist())
        assert np.all(np.diff(chosen.ids) > 0)
    assert sizes == sorted(sizes) and sizes[0] == 512 and sizes[-1] > 2048
    everything = DraftVocabulary.choose(counts, controls, target=1.0, step=4096)
    assert everything.size == vocab and everything.coverage == 1.0  # the last step stops at the vocabulary's end


def test_without_a_corpus_fit_the_ids_are_taken_in_merge_order():
    vocab = 40_000
    counts = CorpusCounts(np.zeros(vocab, np.int64), np.zeros(vocab, np.int64))
    chosen = DraftVocabulary.choose(counts, controls=[39_999, 5])
    assert chosen.size == dv.FALLBACK_SIZE and np.isnan(chosen.coverage)
    assert chosen.ids.tolist() == list(range(dv.FALLBACK_SIZE - 1)) + [39_999]  # the controls, then ids 0, 1, ...
    fit = np.zeros(vocab, np.int64)
    fit[39_000] = 5_000
    thin = CorpusCounts(fit, fit // 1_000)  # 5 held-out tokens: too few to measure a coverage by
    chosen = DraftVocabulary.choose(thin, controls=[])
    assert chosen.ids.tolist() == list(range(dv.FALLBACK_SIZE)) and chosen.coverage == 0.0
    assert DraftVocabulary.choose(counts_of(fit=[3] * 100, heldout=[1] * 100), controls=[]).size == 100  # all ids


def test_a_coverage_target_outside_0_1_and_a_size_outside_the_vocabulary_are_refused():
    counts = counts_of(fit=[1, 2], heldout=[1, 1])
    with pytest.raises(ValueError, match="coverage target"):
        DraftVocabulary.choose(counts, [], target=1.5)
    with pytest.raises(ValueError, match="1..2 ids"):
        DraftVocabulary.of_size(counts, [], 3)


@pytest.fixture(scope="module")
def smollm2():
    from exactspec.models import load_tokenizer

    return load_tokenizer(None)


def test_the_default_models_vocabulary_keeps_its_controls_and_reaches_the_target(smollm2):
    """SmolLM2's tokenizer (49,152 ids, llama.cpp's) over the shipped corpus: counted in a few CPU seconds, and the
    size chosen is the smallest step that covers TARGET_COVERAGE of the held-out text, with EOS and the chat markers
    in it."""
    from exactspec.vocabularies import control_ids

    tokenizer, vocab_size = smollm2
    start = time.process_time()  # CPU seconds, all threads: what the count costs, however busy the machine
    counts = CorpusCounts.of(tokenizer, vocab_size)
    seconds = time.process_time() - start
    assert seconds < 10, f"counting took {seconds:.1f} CPU seconds (3.2 measured)"
    assert 400_000 < counts.fit.sum() + counts.heldout.sum() < 900_000
    controls = control_ids(tokenizer, vocab_size)
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert tokenizer.eos_token_id in controls and len(im_end) == 1 and im_end[0] in controls
    chosen = DraftVocabulary.choose(counts, controls)
    assert chosen.coverage >= dv.TARGET_COVERAGE and chosen.size % dv.SIZE_STEP == 0 and chosen.size < vocab_size
    assert DraftVocabulary.of_size(counts, controls, chosen.size - dv.SIZE_STEP).coverage < dv.TARGET_COVERAGE
    assert controls <= set(chosen.ids.tolist())


# the exact rules with a restricted draft --------------------------------------------------------------------------

# the draft's vocabulary in the enumeration tests (V = 6): it leaves out ids 0 and 3, and draws lean on id 0 and 3
# below, so the target's mass outside the vocabulary is large
DRAFT_IDS = torch.tensor([1, 2, 4, 5])


def restricted_probs(logits: torch.Tensor, params: SamplingParams, ids: torch.Tensor = DRAFT_IDS) -> torch.Tensor:
    """A drafter's distribution over a draft vocabulary ``ids``, widened to the whole vocabulary as DraftVocab does
    (q = 0 elsewhere)."""
    return logits_to_probs(DraftVocab(ids, logits.shape[-1]).widen(logits[..., ids]), params)


def leaning_on_the_outside(generator: torch.Generator, *shape: int, params: SamplingParams) -> torch.Tensor:
    """Target distributions [*shape, V] with extra weight on ids 0 and 3, outside DRAFT_IDS."""
    logits = torch.randn(*shape, V, generator=generator, dtype=torch.float64) * 2
    logits[..., [0, 3]] += 1.5
    return logits_to_probs(logits, params)


@pytest.mark.parametrize("params", SETTINGS)
def test_the_standard_rule_with_a_restricted_draft_emits_exactly_the_target(params):
    """Enumeration of every draft token: one draft position, then a two-token chain's joint of three tokens; q is 0
    off the draft vocabulary, and the target puts weight there."""
    generator = torch.Generator().manual_seed(30)
    outside = []
    for _ in range(20):
        p = leaning_on_the_outside(generator, params=params)
        q = restricted_probs(torch.randn(V, generator=generator, dtype=torch.float64) * 2, params)
        assert q[[0, 3]].sum() == 0 and torch.isclose(q.sum(), torch.tensor(1.0, dtype=q.dtype))
        outside.append(float(p[[0, 3]].sum()))
        assert torch.allclose(first_token_distribution(p, q, q), p, atol=1e-9, rtol=0)
    assert max(outside) > 0.5  # the target's mass outside the draft vocabulary is under test
    p1 = leaning_on_the_outside(generator, params=params)
    p2 = leaning_on_the_outside(generator, V, params=params)
    p3 = leaning_on_the_outside(generator, V, V, params=params)
    q1 = restricted_probs(torch.randn(V, generator=generator, dtype=torch.float64), params)
    q2 = restricted_probs(torch.randn(V, V, generator=generator, dtype=torch.float64), params)
    expected = p1[:, None, None] * p2[:, :, None] * p3
    assert torch.allclose(chain_joint(p1, p2, p3, q1, q2), expected, atol=1e-9, rtol=0)


def test_drafting_over_the_vocabulary_but_testing_with_the_full_q_is_caught():
    """The enumeration has power: a draft drawn from q restricted to its vocabulary, verified with the q it had
    before the cut, emits a biased token."""
    generator = torch.Generator().manual_seed(35)
    params = SamplingParams(temperature=1.0)
    p = leaning_on_the_outside(generator, params=params)
    logits = torch.randn(V, generator=generator, dtype=torch.float64) * 2
    full, drawn = logits_to_probs(logits, params), restricted_probs(logits, params)
    assert torch.allclose(first_token_distribution(p, drawn, drawn), p, atol=1e-9, rtol=0)
    assert not torch.allclose(first_token_distribution(p, full, drawn), p, atol=1e-2)


@pytest.mark.parametrize("params", SETTINGS)
def test_several_restricted_candidates_leave_a_node_as_the_target(params):
    """A tree node's children drawn from a restricted q, and with a fixed candidate from the draft vocabulary."""
    generator = torch.Generator().manual_seed(31)
    for _ in range(5):
        p = leaning_on_the_outside(generator, params=params)
        q = restricted_probs(torch.randn(V, generator=generator, dtype=torch.float64) * 2, params)
        guess = torch.nn.functional.one_hot(torch.tensor(int(q.argmax())), V).double()
        for children in ([(q, q)] * 3, [(None, guess), (q, q)]):
            assert torch.allclose(leaving_distribution(p, children), p, atol=1e-9, rtol=0)


@pytest.mark.parametrize("params", SETTINGS[:2], ids=["T1", "T0.7-topk3"])
def test_a_restricted_draft_loses_at_most_the_targets_mass_outside_it(params):
    """The bound the module's docstring states: the acceptance of a draft renormalised over its vocabulary is at least
    the full draft's less the target's mass outside (temperature and top-k keep every token of the vocabulary the
    full draft kept; top-p can cut more, and is left out)."""
    generator = torch.Generator().manual_seed(32)
    for _ in range(200):
        p = leaning_on_the_outside(generator, params=params)
        logits = torch.randn(V, generator=generator, dtype=torch.float64) * 2
        full, cut = logits_to_probs(logits, params), restricted_probs(logits, params)
        accepted = torch.minimum(p, cut).sum()
        assert accepted >= torch.minimum(p, full).sum() - p[[0, 3]].sum() - 1e-12


def test_greedy_with_a_restricted_draft_is_the_targets_argmax_for_every_vocabulary():
    """Every non-empty draft vocabulary of 6 ids, on 20 pairs of logits: the draft's choice is its argmax within its
    vocabulary; the round keeps it only where it is the target's argmax and otherwise emits that argmax, and the
    zero-temperature standard rule gives the same verdict."""
    generator = torch.Generator().manual_seed(33)
    greedy = SamplingParams(temperature=0.0)
    pairs = [(torch.randn(2, V, generator=generator), torch.randn(2, V, generator=generator)) for _ in range(20)]
    missed = 0
    for size in range(1, V + 1):
        for ids in itertools.combinations(range(V), size):
            vocab = DraftVocab(torch.tensor(ids), V)
            for target_logits, draft_logits in pairs:
                token, probs = vocab.draft_token(draft_logits[0, list(ids)], greedy, generator, 0)
                assert probs is None and token in ids
                assert token == max(ids, key=lambda t: draft_logits[0, t])
                verdict = verify_choices([token], target_logits.argmax(-1))
                best = int(target_logits[0].argmax())
                assert verdict.emitted([token])[0] == best and verdict.accepted == (token == best)
                missed += best not in ids
                q = restricted_probs(draft_logits[:1], greedy, torch.tensor(ids))  # [1, V]: one-hot on the token
                assert q[0, token] == 1
                assert verify(torch.tensor([token]), q, logits_to_probs(target_logits, greedy), generator) == verdict
    assert missed > 100  # the target's choice lies outside the draft vocabulary in many cases


K = 3  # draft tokens a round in the sampled tests
VOCAB_SAMPLED = 40
SAMPLED_SEEDS = 4_000


def sampled_case():
    """Target logits [K+1, 40], draft logits [K, 40] near them, and a draft vocabulary without ids 0-11 nor the
    first row's four likeliest target tokens."""
    generator = torch.Generator().manual_seed(34)
    target = torch.randn(K + 1, VOCAB_SAMPLED, generator=generator, dtype=torch.float64) * 1.5
    draft = target[:K] + 0.5 * torch.randn(K, VOCAB_SAMPLED, generator=generator, dtype=torch.float64)
    left_out = set(target[0].topk(4).indices.tolist()) | set(range(12))
    ids = torch.tensor([t for t in range(VOCAB_SAMPLED) if t not in left_out])
    return target, draft, DraftVocab(ids, VOCAB_SAMPLED), left_out


@pytest.fixture
def one_torch_thread():
    """Rounds over 40 ids a few thousand times: torch's threads cost more than they save on such small rows (a [4, 40]
    softmax takes ~1 ms on two busy cores, 5 us on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def restricted_round(target: torch.Tensor, draft: torch.Tensor, vocab: DraftVocab, params: SamplingParams,
                     generator: torch.Generator, position: int):
    """One round: K draft tokens drawn over the draft vocabulary (DraftVocab.draft_token, as a trained drafter draws
    them), verified as the engine verifies them (step.verify_draft)."""
    tokens, rows = [], []
    for j in range(K):
        token, probs = vocab.draft_token(draft[j, vocab.ids], params, generator, position + j)
        tokens.append(token)
        rows.append(probs)
    probs = None if rows[0] is None else torch.stack(rows)
    verdict = verify_draft(Draft(tokens, probs), target, params, generator, position)
    return tokens, verdict


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit with bins for the outcomes expected at least 5 times and one for the rest."""
    n = observed.sum()
    kept = probs * n >= 5
    observed_bins = np.append(observed[kept], observed[~kept].sum())
    expected_bins = np.append(probs[kept], probs[~kept].sum()) * n
    if expected_bins[-1] < 1e-9:
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    return chisquare(observed_bins, expected_bins * n / expected_bins.sum()).pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["T1", "T0.8-topk20"])
@pytest.mark.usefixtures("one_torch_thread")
def test_the_invariant_sampler_with_a_restricted_draft_emits_the_targets_own_tokens(params):
    """4,000 seeds: each round's tokens are the target's own invariant choices at their positions (plain decoding's,
    whatever the draft), so the first follows p: one chi-square test at alpha = 0.001 per setting (false alarm 0.1%
    each for a correct sampler; the seeds are fixed, so the outcome repeats). Drafts are both kept and cut."""
    target, draft, vocab, left_out = sampled_case()
    p = logits_to_probs(target[0], params).numpy()
    assert p[sorted(left_out)].sum() > 0.3
    first = np.zeros(VOCAB_SAMPLED)
    accepted = rejected = 0
    for seed in range(SAMPLED_SEEDS):
        generator = torch.Generator().manual_seed(seed)
        tokens, verdict = restricted_round(target, draft, vocab, params, generator, position=10)
        assert not set(tokens) & left_out
        emitted = verdict.emitted(tokens)
        assert emitted == [invariant_choice(target[j], params, seed, 10 + j) for j in range(len(emitted))]
        first[emitted[0]] += 1
        accepted += verdict.accepted > 0
        rejected += verdict.accepted < K
    assert chi_square_pvalue(first, p) > 1e-3
    assert first[sorted(left_out)].sum() > 0.2 * SAMPLED_SEEDS  # tokens the draft never proposes are emitted
    assert accepted > 250 and rejected > 250


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, method="standard"),
                                    SamplingParams(temperature=0.8, top_k=20, method="standard")],
                         ids=["T1", "T0.8-topk20"])
@pytest.mark.usefixtures("one_torch_thread")
def test_the_standard_rule_with_a_restricted_draft_samples_the_target(params):
    """4,000 seeded rounds of --sampling standard with q = 0 off the draft vocabulary: the first two tokens follow
    p[0] and p[1] (the rows do not depend on the tokens before them, so the second is p[1] after any first). Two
    chi-square tests at alpha = 0.001 per setting: false alarm about 0.2% each for a correct verifier, before the
    seeds are fixed."""
    target, draft, vocab, left_out = sampled_case()
    p = logits_to_probs(target, params).numpy()  # [K+1, 40]
    first, second = np.zeros(VOCAB_SAMPLED), np.zeros(VOCAB_SAMPLED)
    accepted = 0
    for seed in range(SAMPLED_SEEDS):
        generator = torch.Generator().manual_seed(seed)
        tokens, verdict = restricted_round(target, draft, vocab, params, generator, position=10)
        assert not set(tokens) & left_out
        emitted = verdict.emitted(tokens)
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        accepted += verdict.accepted
    assert chi_square_pvalue(first, p[0]) > 1e-3
    assert chi_square_pvalue(second, p[1]) > 1e-3 and second.sum() > 0.1 * SAMPLED_SEEDS
    assert first[sorted(left_out)].sum() > 0.2 * SAMPLED_SEEDS
    assert accepted > 0.1 * SAMPLED_SEEDS


def test_acceptance_probs_of_a_restricted_draft_are_those_of_its_renormalised_q():
    """A draft token's acceptance min(1, p/q) reads q inside the vocabulary, where restriction raised it."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = restricted_probs(torch.zeros(4, dtype=torch.float64), SamplingParams(temperature=1.0), torch.tensor([1, 2]))
    assert q.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert acceptance_probs(torch.tensor([1]), q[None], p).tolist() == [0.3 / 0.5]
