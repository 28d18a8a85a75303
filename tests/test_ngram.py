"""The ngram drafter (written from tests/templates/): what the house asks of every drafter
(tests/drafter_checks.py), and what it drafts."""

from __future__ import annotations

from drafter_checks import check_drafter

from exactspec.proposers import make_proposer
from exactspec.sampling import SamplingParams


def test_ngram_keeps_plain_decodings_tokens():
    """Drafts of at most k ids in the vocabulary; greedy and seeded output bit for bit plain decoding's, at several
    k and with k auto, on the lean runtime; the same again after clear_cache; and some drafts accepted."""
    check_drafter(lambda target: make_proposer("ngram", target))


def test_ngram_drafts_the_successor_seen_most_often_then_chains_from_it():
    """After 1 2 came 3 twice and 4 once (the latest): the majority's 3, where prompt lookup copies what followed
    the latest occurrence (4 7 1); then what followed 1 2 3 (5, twice), then 2 3 5 (6, twice)."""
    context = [1, 2, 3, 5, 6, 0, 1, 2, 3, 5, 6, 1, 2, 4, 7, 1, 2]
    assert make_proposer("ngram", None).propose(context, 3, SamplingParams(), None).tokens == [3, 5, 6]
    assert make_proposer("prompt-lookup", None).propose(context, 3, SamplingParams(), None).tokens == [4, 7, 1]


def test_ngram_counts_as_the_context_grows_and_starts_again_for_another():
    """A context that extends the last one adds its new n-grams only; another context is counted afresh, so
    nothing of the first leaks into its drafts."""
    proposer = make_proposer("ngram", None)
    assert proposer.propose([8, 9, 8], 2, SamplingParams(), None).tokens == [9, 8]
    assert proposer.propose([8, 9, 8, 7, 8], 1, SamplingParams(), None).tokens == [7]  # a tie of 9 and 7: the latest
    assert proposer.propose([5, 6], 3, SamplingParams(), None).tokens == []  # nothing seen after 6 in this context
