"""The scheduler without HTTP: sampling inside a batch, with speculation, is exact."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare
from tiny import tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.sampling import SamplingParams, logits_to_probs
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.scheduler import GenerationRequest

PROMPT = [3, 4, 3, 4, 3]  # prompt lookup drafts "4 3" after it: drafts are verified, some accepted, some not
PARAMS = SamplingParams(temperature=1.0)


def exact_pair_distribution(model) -> np.ndarray:  # [vocab, vocab]: P(first token, second token)
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1:], PARAMS)[0]  # [vocab]
        contexts = torch.tensor([PROMPT + [t] for t in range(model.config.vocab_size)])
        second = logits_to_probs(model(contexts).logits[:, -1], PARAMS)  # [vocab, vocab]
    return (first[:, None] * second).numpy()


def test_sampling_in_a_batch_with_speculation_draws_from_the_target():
    """The first two tokens of 3000 seeded requests, decoded 32 at a time with every draft scored, against the
    exact joint distribution: chi-square over the pairs expected at least 5 times (the rest pooled); the test
    fails at p < 1e-3, its false-alarm rate (the seeds are fixed, so it is deterministic)."""
    torch.manual_seed(0)
    model = tiny_llama(seed=0, init_range=0.5).double()
    scheduler = build_scheduler(LeanRuntime(model), BatchSettings(speculation="always", max_batch_size=32,
                                                                   max_model_len=16, max_waiting=4096), set())
    scheduler.start()
    handles = [scheduler.submit(GenerationRequest(PROMPT, max_tokens=2, sampling=PARAMS, seed=seed))
               for seed in range(3000)]
    pairs = []
    for handle in handles:
        pairs.append(tuple(handle.collect()[0]))
    scheduler.shutdown(timeout=5)
    metrics = scheduler.metrics  # both ways out of a draft token were taken: accepted, and rejected then recovered
    assert metrics.accepted_tokens > 20 and metrics.draft_tokens > metrics.accepted_tokens + 1000

    expected = exact_pair_distribution(model) * len(pairs)
    observed = np.zeros_like(expected)
    for first, second in pairs:
        observed[first, second] += 1
    big = expected >= 5
    f_obs = np.append(observed[big], observed[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    assert chisquare(f_obs, f_exp).pvalue > 1e-3


def test_a_runtime_that_batches_nothing_is_refused_in_one_line():
    """The pool is the backends' to choose (backends.pool_of): a transformers module (here a qwen2 with a sliding
    window, which exactspec's runtime does not cover) has none, and the server says so."""
    import pytest
    from test_llama_runtime import FAMILY_SHAPE
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from exactspec.backends import HFCausalLM, make_backend
    from exactspec.errors import UsageError

    model = Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE, use_sliding_window=True, sliding_window=8)).eval()
    runtime = make_backend(model)
    assert isinstance(runtime, HFCausalLM)
    with pytest.raises(UsageError, match="the server runs llama-family models"):
        build_scheduler(runtime, BatchSettings(speculation="never"), {1})
