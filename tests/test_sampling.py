"""The logits -> probabilities transform, checked against transformers' own logits warpers; the invariant sampler's
noise and choices, against the exact distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from exactspec.errors import UsageError
from exactspec.sampling import (
    LogitsAdjustment,
    SamplingParams,
    TargetChoices,
    gumbel_choice,
    gumbel_noise,
    invariant_choice,
    logits_to_probs,
    scaled_logits,
)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' order: temperature, top-k, top-p, then softmax."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.05),  # keeps only the top token
    ],
)
def test_matches_transformers_warpers(params):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, params)
    theirs = reference_probs(logits, params)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.equal(ours > 0, theirs > 0)  # the same support, exactly


def test_top_k_and_top_p_counts():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (logits_to_probs(logits, SamplingParams(1.0, top_k=2)) > 0).sum() == 2
    # softmax of these is about [.64, .24, .09, .03, .01]: 0.8 needs the top two, 0.9 the top three
    assert (logits_to_probs(logits, SamplingParams(1.0, top_p=0.8)) > 0).sum() == 2
    assert (logits_to_probs(logits, SamplingParams(1.0, top_p=0.9)) > 0).sum() == 3


def full_sort_cut(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [vocab] -> bool [vocab]: kept
    """Top-k, then top-p, by their definitions over the whole row sorted: top-k keeps the k largest logits and the
    tokens tied with the k-th; top-p, over those, drops a token once the tokens ranked above it reach top_p of their
    probability (float64); tokens tied with the last one kept are kept too."""
    values, _ = torch.sort(logits.double(), descending=True)
    if top_k:
        values = values[values >= values[top_k - 1]]
    probs = torch.softmax(values, -1)
    kept_sorted = (torch.cumsum(probs, 0) - probs) < top_p
    return logits.double() >= values[kept_sorted][-1]


@pytest.mark.parametrize("scale", [0.3, 2.0, 12.0], ids=["flat", "spread", "peaked"])
def test_top_k_and_top_p_keep_what_a_sort_of_the_whole_row_keeps(scale):
    """Top-p looks for its cut among a row's top k, or its top 64 tokens, then 256, 1,024, ... : on rows of 20,000
    logits, flat (thousands kept: the search grows to the whole row), spread and peaked (a few kept), four tied at
    the top of one row and at top-k's cut in another, each row of a batch alone, top-k and top-p keep the tokens
    their definitions keep over the whole row sorted."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 20_000, generator=generator) * scale
    logits[2, 5:9] = logits[2].max() + 1  # four tokens tied at the top
    logits[3, 5:9] = torch.sort(logits[3], descending=True).values[28]  # tied at the 30th's place
    for top_k, top_p in ((0, 0.05), (0, 0.5), (0, 0.9), (0, 0.999), (30, 1.0), (30, 0.5), (30, 0.999)):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        scaled = scaled_logits(logits, params)
        for row in range(logits.shape[0]):
            expected = full_sort_cut(logits[row], top_k, top_p)
            assert torch.equal(torch.isfinite(scaled[row]), expected), (top_k, top_p, row)
            assert torch.equal(scaled_logits(logits[row], params), scaled[row])


def logits_of_kind(kind: str, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` logits: flat, spread or peaked draws; or two levels, 32 at 0 and the rest where a token among them
    wins about half the time, often by a hair over the bound (the top 64 hold 32 of them)."""
    if kind == "two-level":
        logits = torch.full((count,), -math.log(max(count / 32, 1.0)))
        logits[torch.randperm(count, generator=generator)[:32]] = 0.0
        return logits
    return torch.randn(count, generator=generator) * {"flat": 0.1, "spread": 1.0, "peaked": 10.0}[kind]


@pytest.mark.parametrize("support", [1, 3, 40, 4000, 50_000])
@pytest.mark.parametrize("kind", ["flat", "spread", "peaked", "two-level"])
def test_a_choice_is_the_whole_noises_choice(support, kind):
    """The invariant sampler takes the noise's logarithms only for the tokens that can win: the top 64 by logit and
    those whose uniforms could lift them above the best of those. Its choices equal argmax(scaled + the whole
    vocabulary's noise), token for token, 40 seeds each: over 50,000 tokens, flat (many contenders), spread, peaked
    (a few) and two-level (winners just over the bound), where top-k, top-p or a grammar left 1 to 4,000 of them (up
    to the last id), and with ties."""
    generator = torch.Generator().manual_seed(support)
    vocab = 50_000
    for seed in range(40):
        ids = torch.randperm(vocab, generator=generator)[:support]
        ids[0] = vocab - 1 if seed % 2 else ids[0]
        scaled = torch.full((vocab,), float("-inf"))
        scaled[ids] = logits_of_kind(kind, support, generator)
        if seed % 3 == 0 and kind != "two-level":
            scaled[ids[: support // 2]] = float(scaled[ids[0]])  # half of them tied
        scaled -= scaled.max()
        expected = int((scaled.double() + gumbel_noise(seed, 9 + support, vocab)).argmax())
        assert gumbel_choice(scaled, seed, 9 + support) == expected


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3))
    assert torch.equal((probs > 0).sum(-1), torch.ones(3, dtype=torch.long))


def test_half_precision_logits_give_float32_probs():
    logits = torch.randn(2, 10).to(torch.bfloat16)
    assert logits_to_probs(logits, SamplingParams(1.0)).dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top-k"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        SamplingParams(**kwargs)


# --- the invariant sampler -------------------------------------------------------------------------------------------

DRAWS = 8000


def invariant_draws(logits: torch.Tensor, params: SamplingParams, position: int = 7, noise=gumbel_noise
                    ) -> list[int]:
    """One invariant choice per seed 0..DRAWS-1 at one position."""
    scaled = scaled_logits(logits.double(), params)
    return [int((scaled + noise(seed, position, logits.shape[-1])).argmax()) for seed in range(DRAWS)]


def test_gumbel_noise_is_a_function_of_the_seed_and_the_position_alone():
    noise = gumbel_noise(5, 3, 1000)
    assert noise.shape == (1000,) and noise.dtype == torch.float64
    assert torch.equal(noise, gumbel_noise(5, 3, 1000))
    assert not torch.equal(noise, gumbel_noise(5, 4, 1000)) and not torch.equal(noise, gumbel_noise(6, 3, 1000))
    assert not torch.equal(noise, gumbel_noise(5 + (1 << 32), 3, 1000))  # all 64 bits of the seed count
    assert torch.equal(gumbel_noise(-1, 3, 10), gumbel_noise((1 << 64) - 1, 3, 10))  # one seed, two spellings
    assert torch.equal(gumbel_noise(5, 3, 10), noise[:10])  # a narrower vocabulary reads the same noise


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9),
], ids=["T1", "T0.7-topk8", "T1.3-topp0.8", "T0.7-topk12-topp0.9"])
def test_invariant_choices_are_draws_from_the_exact_distribution(params):
    """8,000 seeds' choices at one position against logits_to_probs: bins of the tokens expected at least 5 times,
    plus the rest; one chi-square test at alpha = 0.001 each (a correct sampler fails one of the four with
    probability under 0.4%; the seeds are fixed, so the outcome is repeatable). A token outside top-k / top-p is
    never drawn."""
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    probs = logits_to_probs(logits.double(), params)
    counts = np.bincount(invariant_draws(logits, params), minlength=40)
    assert counts[(probs == 0).numpy()].sum() == 0
    kept = (probs * DRAWS >= 5).numpy()
    observed = np.append(counts[kept], counts[~kept].sum())
    expected = np.append(probs.numpy()[kept], probs.numpy()[~kept].sum()) * DRAWS
    if expected[-1] < 1e-9:  # nothing outside the bins
        observed, expected = observed[:-1], expected[:-1]
    assert kept.sum() >= 5
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


def test_each_position_draws_independently():
    """Choices at positions 7 and 8 of one sequence (the same logits) are independent: a chi-square test of
    independence over 8,000 seeds at alpha = 0.001 (false alarm 0.1%, fixed seeds). Noise keyed by the seed
    alone, the mistake this guards against, makes them equal and fails the same test."""
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])

    def dependence(noise) -> float:
        pairs = zip(invariant_draws(logits, params, 7, noise), invariant_draws(logits, params, 8, noise))
        table = np.zeros((4, 4))
        for first, second in pairs:
            table[first, second] += 1
        return chi2_contingency(table).pvalue

    assert dependence(gumbel_noise) > 1e-3
    assert dependence(lambda seed, position, vocab: gumbel_noise(seed, 0, vocab)) < 1e-9


def test_target_choices_take_each_row_alone_and_only_when_read():
    """A row's choice is the same read from a pass or alone, computed only for the rows read; greedy choices are the
    argmax."""
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    choices = TargetChoices(logits, params, generator, [20, 21, 22, 23, 24])
    assert choices[2] == invariant_choice(logits[2], params, 11, 22) == TargetChoices(logits[2:3], params, generator,
                                                                                        [22])[0]
    assert set(choices._chosen) == {2}
    assert [choices[i] for i in range(5)] == [invariant_choice(row, params, 11, 20 + i) for i, row in enumerate(logits)]
    greedy = TargetChoices(logits, SamplingParams(), generator, [0] * 5)
    assert [greedy[i] for i in range(5)] == logits.argmax(-1).tolist()


def test_an_unknown_sampling_method_is_refused():
    with pytest.raises(UsageError, match="sampling must be one of invariant, standard"):
        SamplingParams(temperature=1.0, method="gumbel")


def test_penalties_on_a_tree_count_each_rows_own_path():
    """A tree's row after a node is penalised for the tokens on that node's path only: each row is the last row of
    the same path drafted as a chain (repeated tokens counted twice)."""
    adjustment = LogitsAdjustment(bias={3: 0.5}, presence_penalty=0.4, frequency_penalty=0.3)
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))  # the pending token's row, then a node's
    counts = torch.zeros(10)
    counts[2] = 1
    draft, parents = [2, 5, 2, 7, 5], [-1, 0, 1, -1, 3]
    tree = adjustment.apply(logits, counts, draft, parents)
    assert torch.equal(tree[0], adjustment.apply(logits[:1], counts, [])[0])
    for node, path in enumerate([[2], [2, 5], [2, 5, 2], [7], [7, 5]]):
        chain_logits = logits[[0] * len(path) + [1 + node]]  # its last row follows the whole path
        assert torch.equal(tree[1 + node], adjustment.apply(chain_logits, counts, path)[-1]), (node, path)
