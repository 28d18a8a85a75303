"""The hybrid drafter (exactspec/proposers/hybrid.py), the default: its cost model over sources (policy.SourcePlan),
its output (plain decoding's, greedy and seeded, whichever source drafts), its stats by source, and the default
model found as its draft model for a target several times its size (loading.found_draft_model)."""

from __future__ import annotations

import logging

import pytest
from test_server import EOS, tiny  # noqa: F401

from exactspec.backends import LeanRuntime
from exactspec.costs import SourcePlan
from exactspec.engine import Engine, GenerationConfig
from exactspec.policy import PlannedByDrafter
from exactspec.proposers import make_proposer
from exactspec.proposers.base import Draft
from exactspec.proposers.hybrid import HybridProposer
from exactspec.proposers.none import NoProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.sampling import SamplingParams

REPEATING = [5, 9, 12, 9, 12, 40, 5, 9, 12, 9, 12, 40, 5, 9, 12, 9]  # copies find continuations here


# --- the cost model over sources --------------------------------------------------------------------------------


def plan_with_pass_costs(names=("copy", "model"), free=("copy",), one=1.0, slope=0.05, **kwargs) -> SourcePlan:
    """A plan whose target passes cost ``one`` for one position and ``slope`` more per position (measured: two
    sizes seen), as the engine reports them."""
    plan = SourcePlan(tuple(names), frozenset(free), **kwargs)
    for positions in (1, 2, 3, 5, 9):
        plan.observe_pass(positions, one + (positions - 1) * slope)
    return plan


def test_an_offer_is_scored_against_what_the_round_emitted():
    plan = SourcePlan(("copy",), frozenset({"copy"}), decay=1.0)
    positions = plan.positions["copy"]
    plan.observe_offer("copy", [1, 2, 3, 4], [1, 2, 7])  # two accepted, the third reached and refused
    assert [(p.accepted, p.reached) for p in positions[:5]] == [(1, 1), (1, 1), (0, 1), (0, 0), (0, 0)]
    plan.observe_offer("copy", [1, 2, 3], [1, 2])  # the round emitted two: the third is untested, not refused
    assert [(p.accepted, p.reached) for p in positions[:3]] == [(2, 2), (2, 2), (0, 1)]


def test_the_plan_drafts_from_the_source_that_pays_and_decodes_plainly_where_none_does():
    plan = plan_with_pass_costs(explore_share=0.0)
    for _ in range(50):  # the copy is accepted whole, the model never
        plan.observe_offer("copy", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7])
    source, k = plan.choose({"copy": 6, "model": 8}, 8)
    assert source == "copy" and k == 6  # all of the offer: each token accepted, each position nearly free
    assert plan.choose({"copy": 0, "model": 8}, 8) == ("model", plan.choose({"model": 8}, 8)[1])  # prior: untried
    for _ in range(50):
        plan.observe_offer("model", [9, 9, 9], [1, 2])
        plan.observe_drafting("model", 3, 0.3)  # and it costs 0.1 of a target pass per token
    assert plan.choose({"copy": 0, "model": 8}, 8) == (None, 0)  # nothing pays: plain decoding


def test_a_model_source_that_is_not_chosen_is_tried_for_a_share_of_the_time():
    """A model source that does not pay drafts a round again once the passes since it last drafted took
    1 / explore_share times what that round costs beyond a plain one (here: its token, 0.1, and the pass's second
    position, 0.05), and not before."""
    plan = plan_with_pass_costs()  # a pass over n positions: 1 + 0.05 (n - 1)
    for _ in range(50):
        plan.observe_offer("model", [9, 9], [1, 2])
    plan.observe_drafting("model", 2, 0.2)
    trial = 0.1 + 0.05
    since, tried = plan.idle["model"], []
    for _ in range(40):
        source, k = plan.choose({"copy": 0, "model": 8}, 8)
        if source == "model":
            assert since >= trial / plan.explore_share and k == 1
            tried.append(since)
            since = 0.0
        else:
            assert source is None and since < trial / plan.explore_share
        seconds = 1.0 + 0.05 * k
        plan.observe_pass(k + 1, seconds)
        since += seconds
    assert len(tried) >= 40 // 4  # it was tried: every third round here


def test_a_size_one_slow_pass_made_dear_is_measured_again_and_falls_at_once():
    """A first pass over 3 positions ten times as slow as it is (a first pass of its size, a busy machine) would keep
    the plan from drafting 2 tokens for good; one round in explore_every drafts a token more than the best, and the
    next fast pass of that size sets its cost at once."""
    plan = SourcePlan(("copy",), frozenset({"copy"}), explore_every=4)
    for positions, seconds in ((1, 1.0), (2, 1.02), (3, 10.0), (4, 1.06)):
        plan.observe_pass(positions, seconds)
    for _ in range(50):
        plan.observe_offer("copy", [1, 2], [1, 2, 3])
    chosen = [plan.choose({"copy": 2}, 2)[1] for _ in range(4)]
    assert chosen == [1, 1, 1, 2]  # the probe: a position more on the fourth round
    plan.observe_pass(3, 1.04)
    assert plan.costs.scoring_seconds(3) == 1.04 and plan.choose({"copy": 2}, 2) == ("copy", 2)


def test_a_models_catching_up_each_round_counts_in_its_cost():
    """A draft model that drafted the round before pays a pass to take in the target's correction before drafting:
    a cost per round, beside its cost per token, that can make a marginal source not pay."""
    plan = plan_with_pass_costs(explore_share=0.0, slope=0.02)
    for _ in range(50):
        plan.observe_offer("model", [1, 9], [1, 2])  # the first token accepted one round in two
        plan.observe_offer("model", [9, 9], [1, 2])
    plan.observe_drafting("model", 1, 0.1)
    assert plan.choose({"model": 4}, 4)[0] == "model"
    plan.observe_drafting("model", 1, 0.1, catch_up_seconds=0.5)
    assert plan.choose({"model": 4}, 4) == (None, 0)


def test_a_long_backlog_to_catch_up_on_weighs_against_trying_a_model():
    """A model that would first catch up on a long prompt pays for it (spread over explore_every rounds), and is
    tried for exploration only once the passes since it drafted took 1 / explore_share times that catching up; with
    a short backlog it drafts."""
    plan = plan_with_pass_costs(explore_every=4)
    for _ in range(50):
        plan.observe_offer("model", [1, 2], [1, 2, 3])  # a good model
    plan.observe_drafting("model", 2, 0.2, catch_up_seconds=35.0, backlog=700)  # 0.05 a token of backlog
    assert plan.choose({"model": 4}, 4, backlogs={"model": 10})[0] == "model"
    assert [plan.choose({"model": 4}, 4, backlogs={"model": 700})[0] for _ in range(8)] == [None] * 8


def test_a_source_that_stops_paying_is_dropped_and_one_that_pays_again_comes_back():
    plan = plan_with_pass_costs(explore_share=0.0)
    accepted = ([1, 2, 3, 4], [1, 2, 3, 4, 5])
    refused = ([1, 2, 3, 4], [8, 2])
    for _ in range(30):
        plan.observe_offer("copy", *accepted)
    assert plan.choose({"copy": 4}, 8)[0] == "copy"
    for _ in range(200):  # old rounds fade (by 0.98 a round): what it does now decides
        plan.observe_offer("copy", *refused)
    assert plan.choose({"copy": 4}, 8)[0] is None
    for _ in range(100):
        plan.observe_offer("copy", *accepted)
    assert plan.choose({"copy": 4}, 8)[0] == "copy"


def test_a_sequence_weighs_its_own_rounds_against_what_the_others_taught():
    """A new sequence starts from the plan's acceptance over every sequence; its own refusals pull its estimate
    down within a few rounds while the plan's, learnt from many, moves little."""
    plan = plan_with_pass_costs(explore_share=0.0, slope=0.2)
    for _ in range(50):
        plan.observe_offer("copy", [1, 2], [1, 2, 3])
    local = plan.local()
    assert plan.acceptances("copy", local)[0] == pytest.approx(plan.acceptances("copy")[0])
    for _ in range(20):
        plan.observe_offer("copy", [1, 2], [5, 6], local)
    assert plan.acceptances("copy")[0] > 0.5 and plan.acceptances("copy", local)[0] < 0.15
    assert plan.choose({"copy": 2}, 8)[0] == "copy" and plan.choose({"copy": 2}, 8, local)[0] is None


# --- the drafter on a model ---------------------------------------------------------------------------------------


def hybrid_engine(model, draft_model=None) -> Engine:
    runtime = LeanRuntime(model)
    source = None if draft_model is None else LeanRuntime(draft_model)
    return Engine(runtime, make_proposer("hybrid", runtime, source), eos_token_ids={EOS})


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("with_draft", ["none", "itself", "other"])
def test_the_hybrid_gives_plain_decodings_tokens(tiny, temperature, with_draft):  # noqa: F811
    """Greedy, and seeded under the invariant sampler: the tokens plain decoding gives, whichever source drafts (the
    target itself as draft model is accepted wherever it drafts; another random model rarely)."""
    from tiny import tiny_llama

    model = tiny[0]
    draft = {"none": None, "itself": model, "other": tiny_llama(seed=3, init_range=0.5).double()}[with_draft]
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens="auto", seed=7, stop_at_eos=False,
                              sampling=SamplingParams(temperature=temperature))
    plain = Engine(LeanRuntime(model), NoProposer(), eos_token_ids={EOS}).generate(REPEATING, config)
    engine = hybrid_engine(model, draft)
    by_model = [0, 0]  # the draft model's draft and accepted tokens over both requests
    for prompt in (REPEATING, REPEATING[3:] + [7, 7]):  # a second request: the plan goes on learning
        result = engine.generate(prompt, config)
        expected = plain.token_ids if prompt is REPEATING else \
            Engine(LeanRuntime(model), NoProposer(), eos_token_ids={EOS}).generate(prompt, config).token_ids
        assert result.token_ids == expected
        stats = result.stats
        assert set(stats.sources) == {"prompt-lookup", "retrieval"} | ({"draft-model"} if draft is not None else set())
        assert sum(accepted for _, accepted in stats.sources.values()) == stats.accepted_tokens
        assert sum(drafted for drafted, _ in stats.sources.values()) == stats.draft_tokens
        by_model = [total + n for total, n in zip(by_model, stats.sources.get("draft-model", (0, 0)))]
    if with_draft == "itself" and temperature == 0.0:
        assert by_model[0] > 0 and by_model[1] == by_model[0]  # the target drafting for itself: all accepted


def test_a_fixed_k_caps_the_hybrids_draft_and_the_policy_reports_each_pass(tiny):  # noqa: F811
    engine = hybrid_engine(tiny[0], tiny[0])
    policy = engine.policy(3)
    assert isinstance(policy, PlannedByDrafter) and policy.next_k(16) == 3
    result = engine.generate(REPEATING, GenerationConfig(max_new_tokens=24, num_draft_tokens=3, stop_at_eos=False))
    assert result.stats.positions.drafted and len(result.stats.positions.drafted) <= 3
    assert engine.proposer.plan.costs.score_seconds  # the passes it was told of


def test_the_hybrid_drafts_trees_from_its_chosen_source(tiny):  # noqa: F811
    runtime = LeanRuntime(tiny[0])
    engine = Engine(runtime, make_proposer("hybrid", runtime, LeanRuntime(tiny[0])), eos_token_ids={EOS})
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, tree=(2, 1), stop_at_eos=False)
    plain = Engine(LeanRuntime(tiny[0]), NoProposer(), eos_token_ids={EOS}).generate(
        REPEATING, GenerationConfig(max_new_tokens=24, num_draft_tokens=1, stop_at_eos=False))
    result = engine.generate(REPEATING, config)
    assert result.token_ids == plain.token_ids and result.stats.draft_nodes > result.stats.draft_tokens


def test_a_draft_that_names_its_source_keeps_it_when_cut():
    """Where scoring is free, the hybrid with prompt lookup alone drafts prompt lookup's own draft, named as its;
    the name stays with the draft's first tokens (what a grammar or the server's planner keeps of it)."""
    hybrid = HybridProposer([PromptLookupProposer()])
    hybrid.observe_pass(1, 1.0)
    hybrid.observe_pass(5, 1.0)
    draft = hybrid.propose(REPEATING, 4, SamplingParams(), None)
    alone = PromptLookupProposer().propose(REPEATING, 4, SamplingParams(), None)
    assert isinstance(draft, Draft) and draft.source == "prompt-lookup" and draft.tokens == alone.tokens
    assert draft.first(2).source == "prompt-lookup" and draft.first(2).tokens == alone.tokens[:2]


def test_copies_are_weighed_by_the_length_of_the_match_they_continue():
    """A copy of what followed a 3-token match and one of what followed a single token are weighed apart (keys
    ``prompt-lookup/3`` and ``prompt-lookup/1``), and both drafts name the source ``prompt-lookup``."""
    lookup = PromptLookupProposer()
    assert lookup.graded([1, 2, 3, 9, 1, 2, 3], 2) == ([9, 1], 3)
    assert lookup.graded([4, 9, 5, 7, 8, 4], 2) == ([9, 5], 1)
    hybrid = HybridProposer([lookup])
    for context in ([1, 2, 3, 9, 1, 2, 3], [1, 2, 3, 9, 1, 2, 3, 9, 1, 2], [4, 9, 5, 7, 8, 4], [4, 9, 5, 7, 8, 4, 9]):
        draft = hybrid.propose(context, 2, SamplingParams(), None)
        assert draft.source in ("prompt-lookup", "")
    assert {"prompt-lookup/3", "prompt-lookup/1"} <= set(hybrid.plan.positions)
    assert hybrid.plan.positions["prompt-lookup/3"][0].accepted == 1  # [9, 1] after [.., 2, 3]: 9 came
    assert hybrid.plan.positions["prompt-lookup/1"][0].accepted == 1


def test_a_draft_model_that_cannot_draft_for_the_target_leaves_the_copies_drafting(caplog):
    """A draft model whose logits are wider than the target's: one line naming why, and the hybrid goes on."""
    from tiny import tiny_llama

    target = LeanRuntime(tiny_llama(seed=0, vocab_size=64))
    wider = LeanRuntime(tiny_llama(seed=1, vocab_size=96))
    with caplog.at_level(logging.WARNING, logger="exactspec.notice"):
        hybrid = make_proposer("hybrid", target, wider)
    assert hybrid.source_names == ("prompt-lookup", "retrieval")
    assert "the hybrid drafts without its draft model: the draft model's logits are wider (96)" in caplog.text


# --- the default model as draft model, found for a larger target ---------------------------------------------------


@pytest.mark.slow  # two GGUFs converted for transformers: about 15 s
def test_the_default_model_drafts_for_a_target_several_times_its_size_and_not_for_a_smaller(
        tmp_path, monkeypatch, caplog):
    """The rule is the gain expected of the draft (its tokenizer, its draft-grade step's bytes against the target's):
    a tiny GGUF stands for the default model, a larger one for the target; where the gain is under
    MIN_EXPECTED_GAIN, nothing loads and --verbose says why."""
    from tiny_gguf import write_tiny_gguf

    from exactspec import SpecDecoder, loading

    small = write_tiny_gguf(tmp_path / "small.gguf", hidden=32, layers=1, tensor_type="F32")
    large = write_tiny_gguf(tmp_path / "large.gguf", hidden=96, layers=2, tensor_type="F32")  # 3x its bytes
    monkeypatch.setattr(loading, "default_model_path", lambda: small)
    with caplog.at_level(logging.INFO, logger="exactspec.detail"):
        found = SpecDecoder.load(str(large), backend="lean", dtype="float32")
        monkeypatch.setattr(loading, "MIN_EXPECTED_GAIN", 1000.0)
        alone = SpecDecoder.load(str(large), backend="lean", dtype="float32")
    assert found.engine.proposer.source_names == ("prompt-lookup", "retrieval", "draft-model")
    assert alone.engine.proposer.source_names == ("prompt-lookup", "retrieval")
    assert "under 1000x" in caplog.text and "the draft model found: small.gguf (its tokenizer" \
        in caplog.text
    prompt = "one two three one two three one two"
    greedy = [SpecDecoder.load(str(large), drafter="none", backend="lean", dtype="float32"), found]
    outputs = [decoder.generate(prompt, max_new_tokens=16).token_ids for decoder in greedy]
    assert outputs[0] == outputs[1]


def test_the_draft_model_drafter_given_no_draft_model_drafts_with_the_one_found(tmp_path, monkeypatch, caplog):
    """--drafter draft-model with no --draft-model drafts with the model the hybrid would find (a tiny GGUF stands
    for the default model beside a target 3x its size), and gives plain decoding's tokens; given a trained drafter's
    directory instead, nothing is looked for. Before, it went for a trained drafter and, with none shipped for the
    target, failed after converting the target to transformers (13 s for the 1.5B)."""
    from tiny_gguf import write_tiny_gguf

    from exactspec import SpecDecoder, loading
    from exactspec.errors import UsageError

    small = write_tiny_gguf(tmp_path / "small.gguf", hidden=32, layers=1, tensor_type="F32")
    large = write_tiny_gguf(tmp_path / "large.gguf", hidden=96, layers=2, tensor_type="F32")
    monkeypatch.setattr(loading, "default_model_path", lambda: small)
    with caplog.at_level(logging.INFO, logger="exactspec.detail"):
        drafting = SpecDecoder.load(str(large), drafter="draft-model", backend="lean", dtype="float32")
    assert "the draft model found: small.gguf" in caplog.text
    assert drafting.engine.proposer.model.vocab_size == drafting.engine.target.vocab_size
    prompt = "one two three one two three one two"
    plain = SpecDecoder.load(str(large), drafter="none", backend="lean", dtype="float32")
    drafted = drafting.generate(prompt, max_new_tokens=16, num_draft_tokens=3)
    assert drafted.stats.draft_tokens > 0
    assert drafted.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids

    def not_looked_for(target_path):
        raise AssertionError("a draft model was looked for beside a trained drafter's directory")

    monkeypatch.setattr(loading, "found_draft_model", not_looked_for)
    with pytest.raises(UsageError, match="drafter directory not found"):  # read, not a found model
        SpecDecoder.load(str(large), drafter="draft-model", drafter_path=str(tmp_path / "none"), backend="lean",
                         dtype="float32")


def test_the_gain_expected_of_a_draft_model_rises_with_its_acceptance_and_falls_with_its_cost():
    from exactspec.draft_grades import PASS_SLOPE, expected_gain

    assert expected_gain(0.0, 0.1) == pytest.approx(1 / (1 + PASS_SLOPE + 0.1))  # nothing accepted: one token
    assert expected_gain(0.9, 0.1) > expected_gain(0.8, 0.1) > expected_gain(0.8, 0.3) > expected_gain(0.8, 0.6)
    assert expected_gain(0.8, 0.05) > expected_gain(0.8, 0.25) > expected_gain(0.55, 0.25) > 1


def test_a_draft_models_prospect_reads_its_tokenizer_and_its_draft_grade_bytes(tmp_path):
    """Two GGUFs of one vocabulary tokenize alike, another vocabulary does not; a draft's cost is its draft-grade
    step's bytes (at most DRAFT_GRADE_BITS a weight, DRAFT_HEAD_ROWS rows of its head) over the target's step's."""
    from tiny_gguf import write_tiny_gguf
    from tiny_vocabularies import sentencepiece_fields

    from exactspec.backends.gguf_file import read_gguf
    from exactspec.loading import DRAFT_GRADE_BITS, DRAFT_HEAD_ROWS, draft_prospect

    small = write_tiny_gguf(tmp_path / "small.gguf", hidden=32, layers=1, tensor_type="F32")
    large = write_tiny_gguf(tmp_path / "large.gguf", hidden=96, layers=2, tensor_type="F32")
    other = write_tiny_gguf(tmp_path / "other.gguf", hidden=32, layers=1, tensor_type="F32",
                           tokenizer=sentencepiece_fields()[0])
    same, cost = draft_prospect(large, small)
    expected = read_gguf(small).streamed_bytes(DRAFT_GRADE_BITS, DRAFT_HEAD_ROWS) / read_gguf(large).streamed_bytes()
    assert same and cost == pytest.approx(expected) and 0 < cost < 0.3
    assert read_gguf(small).streamed_bytes(DRAFT_GRADE_BITS) < read_gguf(small).streamed_bytes() / 5  # F32: 32 bits
    assert not draft_prospect(large, other)[0]


def test_hybrid_with_a_draft_model_it_cannot_bridge_says_so_in_one_line_and_goes_on(tiny, tmp_path, capsys):  # noqa: F811
    """A draft model whose vocabulary holds next to none of the target's frequent tokens (the tiny transformers
    model's word tokenizer against the default model's): one line naming it and why; the text is generated."""
    from test_cli import run_cli
    from tiny import save_with_tokenizer
    from tiny_gguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "target.gguf", hidden=32, layers=1, tensor_type="F32")
    draft = save_with_tokenizer(tiny[0], tmp_path / "words")
    code, out, err = run_cli(capsys, "generate", "Hello there", "--model", str(target), "--draft-model", str(draft),
                             "--max-new-tokens", "4", "--backend", "lean")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "the hybrid drafts without" in line]
    assert len(lines) == 1 and str(draft) in lines[0] and "frequent tokens" in lines[0], err
    assert "[hybrid" in err and "draft-model" not in err.splitlines()[-1]


def test_the_plan_learns_the_pass_costs_it_is_told():
    """A size's cost is the fastest of its last RECENT_PASSES passes: a faster pass sets it at once, a slower one
    leaves it until the faster has left the window."""
    from exactspec.costs import RECENT_PASSES

    plan = SourcePlan(("copy",), frozenset({"copy"}))
    plan.observe_pass(5, 0.03)
    plan.observe_pass(5, 0.05)
    assert plan.costs.scoring_seconds(5) == 0.03
    plan.observe_pass(5, 0.02)
    assert plan.costs.scoring_seconds(5) == 0.02
    for _ in range(RECENT_PASSES - 1):
        plan.observe_pass(5, 0.04)
    assert plan.costs.scoring_seconds(5) == 0.02
    plan.observe_pass(5, 0.04)  # the 0.02 pass is now RECENT_PASSES passes old
    assert plan.costs.scoring_seconds(5) == 0.04


def test_a_busy_machine_leaves_the_pass_sizes_costs_in_their_true_order():
    """Passes of one size measured often and of another seldom, each slowed now and then by another process (a
    seeded draw: a quarter of the passes 1.5x as long): the often-passed size, the cheaper, stays the cheaper, and
    each cost is within the quiet figure's noise-free value and the slowed one. (A moving average that a slow pass
    moved up and a fast one set stood higher for the size passed most, here above the dearer size's.)"""
    import random

    draw = random.Random(5)
    plan = SourcePlan(("copy",), frozenset({"copy"}))
    quiet = {1: 1.0, 2: 1.05}
    for round_ in range(400):
        size = 2 if round_ % 10 == 0 else 1
        plan.observe_pass(size, quiet[size] * (1.5 if draw.random() < 0.25 else 1.0))
        assert plan.costs.scoring_seconds(1) < plan.costs.scoring_seconds(2) or round_ < 20
    assert all(quiet[size] <= plan.costs.scoring_seconds(size) <= 1.5 * quiet[size] for size in quiet)


# --- trained heads beside the copies ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_trained_heads_draft_beside_the_copies_and_change_no_token(tiny, method, temperature):  # noqa: F811
    """An eagle head or mtp heads (untrained: they draft badly) as the hybrid's sources: it declares that it reads
    the target's hidden states, hands them to the head that drafts, and the tokens are plain decoding's, greedy and
    seeded; the head drafted (before its cost and acceptance are measured it is the longest offer)."""
    import copy

    from test_rounds import untrained_source

    from exactspec.backends.base import declares
    from exactspec.proposers.base import FeatureProposer
    from exactspec.proposers.hybrid import HybridSources

    model = copy.deepcopy(tiny[0]).float()
    runtime = LeanRuntime(model)
    hybrid = make_proposer("hybrid", runtime, HybridSources(None, ((method, untrained_source(method, model)),)))
    assert declares(hybrid, FeatureProposer) and hybrid.source_names == ("prompt-lookup", "retrieval", method)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens="auto", seed=7, stop_at_eos=False,
                              sampling=SamplingParams(temperature=temperature))
    plain = Engine(LeanRuntime(model), NoProposer(), eos_token_ids={EOS}).generate(REPEATING, config)
    result = Engine(runtime, hybrid, eos_token_ids={EOS}).generate(REPEATING, config)
    assert result.token_ids == plain.token_ids
    assert result.stats.sources[method][0] > 0


def test_hybrid_takes_a_trained_heads_path_and_says_where_it_cannot_use_it(tiny, tmp_path, caplog):  # noqa: F811
    """``--drafter hybrid --drafter-path DIR`` with an eagle drafter: loaded beside the copies, the answer plain
    decoding's. A path to another kind of trained drafter is refused in one line; on a runtime that hands over no
    hidden states the hybrid goes on without the head, saying so in one line."""
    import copy
    from dataclasses import replace

    from test_rounds import untrained_source
    from tiny import save_with_tokenizer

    from exactspec import SpecDecoder
    from exactspec.backends.base import CausalLM
    from exactspec.drafters import checkpoint
    from exactspec.errors import UsageError
    from exactspec.loading import trained_heads
    from exactspec.models import weight_probe

    model = copy.deepcopy(tiny[0]).float()
    path = save_with_tokenizer(model, tmp_path / "target")
    head = untrained_source("eagle", model)
    head.config = replace(head.config, target={"name": "tiny", "probe": weight_probe(model)})
    checkpoint.save(head, tmp_path / "eagle")
    decoder = SpecDecoder.load(str(path), drafter="hybrid", drafter_path=str(tmp_path / "eagle"), backend="lean",
                               dtype="float32")
    assert decoder.engine.proposer.source_names == ("prompt-lookup", "retrieval", "eagle")
    plain = SpecDecoder.load(str(path), drafter="none", backend="lean", dtype="float32")
    prompt = "w3 w5 w3 w5 w3"
    assert decoder.generate(prompt, max_new_tokens=12).token_ids == plain.generate(prompt, max_new_tokens=12).token_ids
    with pytest.raises(UsageError, match="holds a trained early-exit drafter; the hybrid drafts with trained heads"):
        trained_heads(None, None, f"early-exit={tmp_path}")

    class Plain(CausalLM):  # a runtime that declares nothing beyond CausalLM: no hidden states
        vocab_size, max_length = 64, 128

    with caplog.at_level(logging.WARNING, logger="exactspec.notice"):
        assert trained_heads(None, Plain(), str(tmp_path / "eagle")) == ()
    assert "the hybrid drafts without its eagle heads: Plain hands over no hidden states" in caplog.text
