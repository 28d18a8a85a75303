"""What the house asks of every drafter, as one check a drafter's test calls (tests/templates/test_drafter.py.tmpl).

On a tiny structured llama (its greedy answers follow a graph, so drafts can be right), on the lean runtime:
- every draft holds at most k ids, each in the target's vocabulary, and a tree draft names its parents in order;
- greedy output, and seeded output under the invariant sampler, are plain decoding's bit for bit, at several fixed k
  and with k auto;
- the same again after ``clear_cache``;
- some draft tokens were accepted (a drafter that never drafts passes the rest, and says nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tiny import require_pass_invariant, structured_llama

from exactspec.backends import LeanRuntime
from exactspec.backends.base import declares
from exactspec.engine import Engine, GenerationConfig
from exactspec.proposers import NoProposer
from exactspec.proposers.base import TreeProposer
from exactspec.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 5, 9], [40, 41, 42, 43, 40, 41, 42], [7] * 6, [3, 60, 12, 33, 3, 60]]
NEW_TOKENS = 32


@functools.cache
def _target():
    return structured_llama(seed=3)


def _outputs(engine: Engine, k: int | str, sampling: SamplingParams, seed: int | None, tree=None) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=k, sampling=sampling, seed=seed,
                              stop_at_eos=False, tree=tree)
    return [engine.generate(list(prompt), config).token_ids for prompt in PROMPTS]


def check_drafts(proposer, vocab_size: int) -> None:
    """At most k ids in the vocabulary, from any context, for every k."""
    generator = torch.Generator().manual_seed(0)
    for length in (1, 2, 9, 40):
        context = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        for k in (1, 2, 5, 8):
            draft = proposer.propose(context, k, SamplingParams(), None)
            assert len(draft) <= k and all(0 <= t < vocab_size for t in draft.tokens), (context, k, draft)
            if declares(proposer, TreeProposer):
                tree = proposer.propose_tree(context, [2, 2, 1], SamplingParams(), None)
                parents = tree.parents or [-1] + list(range(len(tree) - 1))
                assert all(p < i for i, p in enumerate(parents)), tree


def check_drafter(make: Callable[[LeanRuntime], object]) -> None:
    """``make(target runtime)`` -> the proposer under test; every check above."""
    target = require_pass_invariant(LeanRuntime(_target()))
    proposer = make(target)
    check_drafts(proposer, target.vocab_size)
    plain, speculating = Engine(target, NoProposer()), Engine(target, proposer)
    accepted = 0
    for sampling, seed in ((SamplingParams(), None), (SamplingParams(temperature=1.0), 11)):
        expected = _outputs(plain, 1, sampling, seed)
        for k in (1, 3, 8, "auto"):
            assert _outputs(speculating, k, sampling, seed) == expected, (k, sampling)
        if declares(proposer, TreeProposer):
            assert _outputs(speculating, 3, sampling, seed, tree=(2, 1)) == expected, ("tree", sampling)
        proposer.clear_cache()
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, sampling=sampling, seed=seed,
                                  stop_at_eos=False)
        for prompt, tokens in zip(PROMPTS, expected):
            result = speculating.generate(list(prompt), config)
            assert result.token_ids == tokens
            accepted += result.stats.accepted_tokens
    assert accepted > 0, "no draft token was ever accepted"
