"""Drafters on their own: what prompt lookup copies, what a draft model proposes."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from exactspec.backends import HFCausalLM, LeanRuntime
from exactspec.proposers import DraftModelProposer, NoProposer, PromptLookupProposer, make_proposer
from exactspec.proposers.base import trie_draft
from exactspec.sampling import SamplingParams, logits_to_probs

GREEDY = SamplingParams()


def lookup(context, k=4, **kwargs):
    return PromptLookupProposer(**kwargs).propose(context, k, GREEDY, None)


def test_prompt_lookup_copies_what_followed_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    draft = lookup(context)
    assert draft.tokens == [7, 8, 5, 1] and draft.probs is None  # the later "1 2 3" wins


def test_prompt_lookup_prefers_the_longest_ngram():
    # the trigram "4 5 6" occurs once, followed by 7; the unigram "6" occurs later, followed by 0
    context = [4, 5, 6, 7, 7, 6, 0, 0, 4, 5, 6]
    assert lookup(context, k=2).tokens == [7, 7]
    assert lookup(context, k=2, max_ngram=1).tokens == [0, 0]


def test_prompt_lookup_continuation_may_run_to_the_end_of_the_context():
    assert lookup([3, 4, 3, 4], k=5).tokens == [3, 4]  # "3 4" matched at 0, followed by the tail itself


def test_prompt_lookup_without_a_match_drafts_nothing():
    assert lookup([1, 2, 3, 4, 5]).tokens == []
    assert lookup([7]).tokens == []
    assert lookup([1, 2, 1, 2], k=0).tokens == []


def test_prompt_lookup_trees_branch_where_the_tail_was_followed_differently():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 9, 4, 1, 2, 3, 7, 8, 1, 2, 3]
    draft = PromptLookupProposer().propose_tree(context, [3, 1], GREEDY, None)
    # the latest "1 2 3" was followed by 7 8, the one before by 9 4: two branches of two
    assert (draft.tokens, draft.parents, draft.probs) == ([7, 8, 9, 4], [-1, 0, -1, 2], None)
    assert PromptLookupProposer().propose_tree(context, [1, 1], GREEDY, None).tokens == [7, 8]  # one: a chain


def test_a_trie_merges_the_shared_prefixes_of_continuations():
    draft = trie_draft([[5, 6, 7], [5, 8], [9]])
    assert (draft.tokens, draft.parents) == ([5, 6, 7, 8, 9], [-1, 0, 1, 0, -1])
    assert trie_draft([]).tokens == [] and trie_draft([]).parents is None


def test_none_drafts_nothing():
    assert NoProposer().propose([1, 2, 3], 4, GREEDY, None).tokens == []


@pytest.mark.parametrize("backend_class", [HFCausalLM, LeanRuntime])
def test_draft_model_greedy_draft_is_its_own_greedy_continuation(backend_class):
    model = tiny_llama(seed=5, init_range=0.5).double()
    proposer = DraftModelProposer(backend_class(model), target_vocab_size=64)
    context = [3, 8, 13, 21]
    ids = list(context)
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    draft = proposer.propose(context, 5, GREEDY, None)
    assert draft.tokens == ids[len(context):] and draft.probs is None
    # a second call after a "rejection" (different continuation) drops the stale draft tokens from its cache
    again = proposer.propose(context + [ids[4], 2], 3, GREEDY, None)
    with torch.no_grad():
        fresh = int(model(torch.tensor([context + [ids[4], 2]])).logits[0, -1].argmax())
    assert again.tokens[0] == fresh


def test_draft_model_sampled_draft_carries_its_distributions_padded_to_the_target():
    model = tiny_llama(seed=6, vocab_size=60, init_range=0.5).double()
    proposer = make_proposer("draft-model", HFCausalLM(tiny_llama(seed=0)), HFCausalLM(model))
    params = SamplingParams(temperature=0.8, top_k=10, method="standard")
    context = [3, 8, 13, 21]
    draft = proposer.propose(context, 3, params, torch.Generator().manual_seed(0))
    assert draft.probs.shape == (3, 64)
    assert torch.all(draft.probs[:, 60:] == 0)
    with torch.no_grad():
        logits = model(torch.tensor([context + draft.tokens[:2]])).logits[0, -3:]
    assert torch.allclose(draft.probs[:, :60], logits_to_probs(logits, params), atol=1e-12)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
