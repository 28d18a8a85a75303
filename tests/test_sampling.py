"""The logits -> probabilities transform, checked against transformers' own logits warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.errors import UsageError
from specdec.sampling import SamplingParams, logits_to_probs


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
