"""A draft model reads a bounded window of a long context (issue 61): its first tokens and its recent ones
(``proposers/draft_model.py``'s ContextWindow), for a draft of the target's vocabulary and one across tokenizers.

The view grows as the context grows, so the draft's cache is kept and only new tokens are fed after the first
catch-up; the cut moves only past twice the window; another sequence is cut afresh. And whatever the draft reads,
greedy and seeded (invariant) output is plain decoding's token for token, with the one-call chain (fused runtime)
and the Python chain, chains and trees, and across tokenizers.

Tiny random GGUFs (tests/tiny_gguf.py; tests/tiny_vocabularies.py for the pair across tokenizers).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf
from tiny_vocabularies import sentencepiece_fields, sub_vocabulary

from exactspec.backends import native
from exactspec.backends.base import CHAIN_LEAD
from exactspec.backends.fused import FusedRuntime
from exactspec.costs import AUTO_MAX_K
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import UsageError
from exactspec.loading import draft_source, load_target
from exactspec.proposers import NoProposer
from exactspec.proposers import draft_model as draft_models
from exactspec.proposers.draft_model import (
    DRAFT_WINDOW,
    DRAFT_WINDOW_HEAD,
    ContextWindow,
    DraftModelProposer,
    ForeignDraftProposer,
)
from exactspec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))

W, HEAD = 16, 8  # a window and a head far shorter than the prompts, so that every run cuts, and cuts again
SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 512}
PROMPT = [(53 * i) % 4000 + 7 for i in range(150)]
SAMPLINGS = ((SamplingParams(), None), (SamplingParams(temperature=0.8, method="invariant"), 5))


def cut_of(window: ContextWindow, ids: list[int]) -> int:
    """Where the window cuts ``ids`` (0: no cut), read from its view."""
    view = window.view(ids)
    return 0 if view == ids else len(ids) - (len(view) - HEAD)


def test_a_list_up_to_the_head_and_the_window_is_its_own_view():
    """As the defaults read it too: a draft reads a context no longer than them whole, as it did before windows."""
    ids = list(range(HEAD + W))
    assert ContextWindow(W, HEAD).view(ids) == ids
    short = list(range(DRAFT_WINDOW_HEAD + DRAFT_WINDOW))
    assert ContextWindow().view(short) == short and ContextWindow().view(short + [0]) != short + [0]
    assert ContextWindow(None, HEAD).view(list(range(5000))) == list(range(5000))
    with pytest.raises(UsageError, match="at least one token"):
        ContextWindow(0, HEAD)


@pytest.mark.parametrize("seed", range(3))
def test_the_view_grows_with_the_list_and_moves_its_cut_only_past_twice_the_window(seed):
    """A list growing by 1 to 5 ids at a time (a round's accepted tokens and its own): each view is the list's head
    and its ids from the cut; the cut is made when the list first exceeds head + W (W ids after it), and moved (to
    W ids from the end) only when the ids past it exceed 2W; between moves each view extends the last."""
    draw = random.Random(seed)
    window, ids, previous, cut = ContextWindow(W, HEAD), [], [], 0
    moves = 0
    while len(ids) < 600:
        ids += [draw.randrange(1000) for _ in range(draw.randint(1, 5))]
        due = len(ids) - (cut or HEAD) > (2 * W if cut else W)
        view = window.view(ids)
        if due:
            cut, moves = len(ids) - W, moves + 1
            assert view == ids[:HEAD] + ids[-W:]
        else:
            assert view[: len(previous)] == previous
        assert view == (ids[:HEAD] + ids[cut:] if cut else ids)
        assert len(view) <= HEAD + 2 * W
        previous = view
    assert moves >= (600 - HEAD - W) // (W + 5)  # at most W + 5 ids come between two moves


def test_another_sequence_is_cut_afresh_and_a_continuation_keeps_its_cut():
    """A list that continues the one cut (more ids, or other ids past the cut: rejected drafts rewritten) keeps the
    cut; one whose ids before the cut differ, or that is shorter than the cut, is a new sequence."""
    window = ContextWindow(W, HEAD)
    first = list(range(200))
    assert cut_of(window, first) == 200 - W
    assert cut_of(window, first + [7] * 10) == 200 - W
    assert cut_of(window, first[:195] + [9] * 15) == 200 - W
    other = first[:100] + [999] + first[101:] + [7] * 10  # differs at 100, before the cut
    assert cut_of(window, other) == len(other) - W
    assert cut_of(window, first[: HEAD + W]) == 0
    assert cut_of(window, first) == 200 - W
    window.forget()
    assert cut_of(window, first + [7] * 10) == 210 - W


def test_unview_puts_back_the_ids_before_the_cut():
    """A draft cache (a view, then drafted tokens) stands for the list it views, the same drafted tokens after it;
    a cache that is no view of the current cut (empty, or another head) stands for itself."""
    window, ids = ContextWindow(W, HEAD), list(range(300))
    view = window.view(ids)
    assert window.unview(view + [5, 6]) == ids + [5, 6]
    assert window.unview([]) == [] and window.unview([1, 2, 3]) == [1, 2, 3]
    other = [9] * HEAD + view[HEAD:]
    assert window.unview(other) == other
    assert ContextWindow(W, HEAD).unview(view) == view  # no cut made yet


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama with 4-bit blocks, and another of other weights (its drafts are rejected more)."""
    folder = tmp_path_factory.mktemp("window")
    return (write_tiny_gguf(folder / "target.gguf", seed=3, tensor_type="Q4_0", **SHAPE),
            write_tiny_gguf(folder / "other.gguf", seed=4, tensor_type="Q8_0", **SHAPE))


def counting(runtime: FusedRuntime) -> list[int]:
    """The tokens each pass over ``runtime`` feeds it (an extend's ids; a one-call chain's lead and the k - 1 drafted
    tokens it feeds back), recorded as they come."""
    fed: list[int] = []
    extend, chain = runtime.extend, runtime.draft_chain
    runtime.extend = lambda ids, num_logits: fed.append(len(ids)) or extend(ids, num_logits)
    runtime.draft_chain = lambda lead, k, *rest: fed.append(len(lead) + k - 1) or chain(lead, k, *rest)
    return fed


@pytest.mark.parametrize("one_call", [True, False])
def test_after_the_first_catch_up_only_new_tokens_are_fed(paths, one_call):
    """Rounds of drafting k = 4 from a 150-token prompt, each accepting a drawn prefix and adding one token of its
    own: the catch-up feeds the head and the window (less the last CHAIN_LEAD tokens, which the draft's first pass
    feeds), not the prompt; each round then feeds the tokens the cache lacks (one or two) and the chain's k - 1,
    k + 1 at most, except the first (the prompt's last CHAIN_LEAD) and where the cut moved: W more."""
    draft = FusedRuntime.from_gguf(paths[0])
    proposer = DraftModelProposer(draft, draft.vocab_size, window=W, head=HEAD)
    if not one_call:
        proposer._chains_in_one_call = lambda params: False
    fed = counting(draft)
    assert proposer.backlog(PROMPT) == HEAD + W - CHAIN_LEAD  # what it says it would feed (the prompt: 150 tokens)
    proposer.catch_up(PROMPT)
    assert sum(fed) == HEAD + W - CHAIN_LEAD
    draw, context, cut, k = random.Random(0), list(PROMPT), len(PROMPT) - W, 4
    for round_ in range(40):
        fed.clear()
        backlog = proposer.backlog(context)
        proposer.catch_up(context)
        assert sum(fed) == backlog  # told before it is fed: the planner weighs a catch-up by it
        tokens = proposer.propose(context, k, SamplingParams(), None).tokens
        moved = len(context) - cut > 2 * W
        if moved:
            cut = len(context) - W
        most = W + k if moved else CHAIN_LEAD + k - 1 if round_ == 0 else k + 1
        assert len(tokens) == k and sum(fed) <= most, (moved, fed)
        view = context[:HEAD] + context[cut:]
        assert draft.tokens == view + tokens[:-1]  # the view, and the tokens drafted after it
        context += tokens[: draw.randint(0, k)] + [draw.randrange(1000)]


@pytest.mark.slow
def test_a_windowed_draft_model_emits_plain_decodings_tokens(paths):
    """Greedy and seeded (invariant) output with a draft model that reads a 16-token window of a 150-token prompt
    (and its 8 first tokens): plain decoding's, token for token, k = 4 and auto, chains and trees, with the one-call
    chain and with the Python chain; drafts of the target's own weights are accepted (the windowed draft is not
    the target's function, so some are not), drafts of other weights rejected more."""
    target = FusedRuntime.from_gguf(paths[0])
    calls, accepted = [], 0
    for sampling, seed in SAMPLINGS:
        config = GenerationConfig(max_new_tokens=40, sampling=sampling, seed=seed, num_draft_tokens=4,
                                  stop_at_eos=False)
        expected = Engine(target, NoProposer()).generate(PROMPT, config).token_ids
        for path in paths:
            draft = FusedRuntime.from_gguf(path)
            chain = draft.draft_chain
            draft.draft_chain = lambda *args, chain=chain: calls.append(1) or chain(*args)
            for one_call in (True, False):
                proposer = DraftModelProposer(draft, target.vocab_size, window=W, head=HEAD)
                if not one_call:
                    proposer._chains_in_one_call = lambda params: False
                for k, tree in ((4, None), ("auto", None), (3, (3, 2, 1))):
                    result = Engine(target, proposer).generate(PROMPT, replace(config, num_draft_tokens=k, tree=tree))
                    assert result.token_ids == expected, (path.name, one_call, k, tree, sampling)
                    accepted += result.stats.accepted_tokens if path == paths[0] else 0
    assert calls and accepted > 0


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory) -> tuple[str, str]:
    """A SentencePiece vocabulary and a shuffled sub-vocabulary of it (some merges gone, other ids): a model over
    the sub-vocabulary computes the first's function on the tokens they share, so it drafts well."""
    folder = tmp_path_factory.mktemp("window-vocabularies")
    fields, tokens = sentencepiece_fields(order_seed=5)
    sub, rows = sub_vocabulary(tokens, drop=0.4, seed=7)
    return (str(write_tiny_gguf(folder / "spm.gguf", tokenizer=fields)),
            str(write_tiny_gguf(folder / "sub.gguf", tokenizer=sub, token_rows=(rows, len(tokens)))))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["text", "intersection"])
def test_a_windowed_draft_across_tokenizers_emits_plain_decodings_tokens(vocabularies, method):
    """The sub-vocabulary's model drafting for the SentencePiece one, reading its own tokens through a 16-token window
    for a long prompt: plain decoding's tokens, greedy and seeded, k = 3 and auto; drafts accepted. The draft's
    catch-up feeds it the head and the window, not the prompt; no pass after it feeds more than a moved cut's W
    tokens and a round's drafting, so no round re-reads the view (the tokens the draft wrote are read back through
    it, and kept where the target wrote them); its cache never holds more than the head, twice the window and a
    round's drafting (text: up to 2(k+1) of its tokens)."""
    loaded = load_target(vocabularies[0], backend="fused", draft_model=vocabularies[1], drafters=("draft-model",))
    source = draft_source("draft-model", loaded.target, loaded.runtime, loaded.draft, loaded.precision,
                          cross_vocabulary=method)
    prompt = loaded.target.tokenizer.encode("write a function that returns the prime number one two three " * 20)
    assert len(prompt) > 4 * (HEAD + W)  # and its own tokens more
    plain = Engine(loaded.runtime, NoProposer(), loaded.stop_ids)
    drafting = 2 * (AUTO_MAX_K + 1)
    accepted = 0
    for sampling, seed in SAMPLINGS:
        config = GenerationConfig(max_new_tokens=32, sampling=sampling, seed=seed, stop_at_eos=False)
        expected = plain.generate(prompt, replace(config, num_draft_tokens=1)).token_ids
        for k in (3, "auto"):
            proposer = draft_models.make(loaded.runtime, source.on(source.model), None, window=W, head=HEAD)
            assert isinstance(proposer, ForeignDraftProposer)
            proposer.clear_cache()
            assert proposer.backlog(prompt) == HEAD + W - CHAIN_LEAD  # its own tokens' view, not the target's prompt
            fed, lengths = counting_cache(proposer.model)
            engine = Engine(loaded.runtime, proposer, loaded.stop_ids)
            result = engine.generate(prompt, replace(config, num_draft_tokens=k))
            assert result.token_ids == expected, (method, sampling, k)
            assert fed[0] <= HEAD + W and max(fed[1:]) <= max(W, drafting), fed
            assert max(lengths) <= HEAD + 2 * W + drafting, lengths
            accepted += result.stats.accepted_tokens
    assert accepted > 0


def counting_cache(runtime) -> tuple[list[int], list[int]]:
    """The tokens each pass feeds ``runtime`` (an extend's ids; a one-call chain's lead and the k - 1 drafted tokens
    it feeds back), and the length of its cache after each, recorded as they come."""
    fed: list[int] = []
    lengths: list[int] = []
    extend, chain = runtime.extend, runtime.draft_chain

    def counted(ids, num_logits):
        fed.append(len(ids))
        logits = extend(ids, num_logits)
        lengths.append(len(runtime.tokens))
        return logits

    def counted_chain(lead, k, *rest):
        fed.append(len(lead) + k - 1)
        drafted = chain(lead, k, *rest)
        lengths.append(len(runtime.tokens))
        return drafted
    runtime.extend, runtime.draft_chain = counted, counted_chain
    return fed, lengths


def test_the_window_bench_reads_each_window_and_refuses_others_in_one_line():
    """``python -m exactspec.bench.draft_window --windows``: W (the default head), W/H, or off (the whole context)."""
    from exactspec.bench.draft_window import parse_windows

    assert parse_windows("128,256/64,off", 32) == [(128, 32), (256, 64), (None, 32)]
    for bad in ("0", "abc", "off/8", "128/", "-5"):
        with pytest.raises(UsageError, match="--windows"):
            parse_windows(bad, 32)
