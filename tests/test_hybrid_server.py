"""The hybrid drafter (the default) in the server (issue 51), on the tiny random model of test_server.py (float64: no
rounding near-ties): the same greedy tokens as ``--drafter none``, with its copies alone and with a draft model;
``/metrics`` and the stream counting draft and accepted tokens by the source that drafted them; one cost model
(``SourcePlan``) shared by every request's hybrid, so that each request starts from what the earlier ones measured."""

from __future__ import annotations

import pytest
from test_server import post, scrape, start_server, stream, tiny  # noqa: F401  (tiny: the model fixture)
from tiny import perturbed_copy

from exactspec.backends import LeanRuntime
from exactspec.choices import DEFAULT_DRAFTER
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.scheduler import GenerationRequest

EOS = 1
PROMPTS = [[5, 9, 12, 9, 12, 40, 5, 9, 12, 9], [7, 3, 7, 3, 7, 3, 7], [20, 21, 22, 23, 20, 21, 22], [4, 8, 15, 16]]
COPIES = {"prompt-lookup", "retrieval"}


def served(runtime, settings: BatchSettings, prompts: list[list[int]], draft=None, max_tokens: int = 16,
           prepare=None):
    """Greedy answers to ``prompts``, submitted all at once to a scheduler as ``serve`` builds it (``prepare``d
    before it starts, where given); the scheduler; each request's drafter as it was made."""
    scheduler = build_scheduler(runtime, settings, {EOS}, draft=draft)
    made, make = [], scheduler.new_proposer
    scheduler.new_proposer = lambda: made.append(make()) or made[-1]
    if prepare is not None:
        prepare(scheduler)
    scheduler.start()
    try:
        handles = [scheduler.submit(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, stop_at_eos=False))
                   for prompt in prompts]
        answers = [handle.collect(timeout=30) for handle in handles]
    finally:
        scheduler.shutdown(timeout=5)
    assert all(finished.reason == "length" for _, finished, _ in answers)
    return [tokens for tokens, _, _ in answers], scheduler, made


def settings(drafter: str = DEFAULT_DRAFTER, **extra) -> BatchSettings:
    return BatchSettings(drafter=drafter, **{"speculation": "always", "num_draft_tokens": 4, "max_batch_size": 4,
                                             "max_model_len": 128, **extra})


@pytest.mark.parametrize("speculation", ["always", "auto"])
def test_the_default_drafter_serves_the_tokens_of_no_drafter(tiny, speculation):  # noqa: F811
    """Greedy requests in one batch, the hybrid (copies only) against ``--drafter none``: token for token the same;
    the hybrid's rounds drafted (under ``always``), each from one of its copies."""
    runtime = LeanRuntime(tiny[0])
    plain, _, _ = served(runtime, settings("none", speculation="never"), PROMPTS)
    answers, scheduler, made = served(runtime, settings(speculation=speculation), PROMPTS)
    assert answers == plain
    assert {proposer.name for proposer in made} == {"hybrid"}
    metrics = scheduler.metrics
    assert set(metrics.draft_tokens_by_source) <= COPIES
    if speculation == "always":
        assert metrics.draft_tokens > 0 and sum(metrics.draft_tokens_by_source.values()) == metrics.draft_tokens


def test_the_default_drafter_with_a_draft_model_serves_the_tokens_of_no_drafter(tiny):  # noqa: F811
    """The hybrid with a draft model (another tiny model over the same vocabulary, each request in a slot of its
    pool) beside its copies: the same greedy tokens as ``--drafter none``, and the draft model drafted too (while
    the copies win, it drafts one round in 16 anyway)."""
    runtime = LeanRuntime(tiny[0])
    draft = LeanRuntime(perturbed_copy(tiny[0], noise=0.05, seed=1).double())
    plain, _, _ = served(runtime, settings("none", speculation="never"), PROMPTS, max_tokens=24)
    answers, scheduler, made = served(runtime, settings(), PROMPTS, draft=draft, max_tokens=24)
    assert answers == plain
    assert {name for proposer in made for name in proposer.source_names} == COPIES | {"draft-model"}
    drafted = scheduler.metrics.draft_tokens_by_source
    assert drafted.get("draft-model", 0) > 0 and sum(drafted.values()) == scheduler.metrics.draft_tokens
    assert scheduler.metrics.drafter_errors == 0  # catching up to what its sequence holds is no pass, no fault


def test_metrics_and_the_stream_count_accepted_tokens_by_the_source_that_drafted_them(tiny):  # noqa: F811
    """Answers that repeat their prompt (a bias makes every token w3, as the prompt is): the copies' drafts are
    accepted, and /metrics counts them under the copies' labels; by source, draft and accepted tokens add up to
    the totals. A stream with ``include_speculation`` names each round's source; its accepted tokens by source add
    up to the request's accepted tokens."""
    server = start_server(tiny, speculation="always", max_batch_size=4, max_model_len=128)
    try:
        body = {"prompt": "w3 w3 w3 w3", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"3": 100}}
        for _ in range(2):
            status, answer = post(server, "/v1/completions", body)
            assert status == 200, answer
        events = stream(server, "/v1/completions", {**body, "stream_options": {"include_speculation": True,
                                                                               "include_usage": True}})
        _, samples, types = scrape(server)
    finally:
        server.shutdown(timeout=5)
    by_source = {kind: {labels[0][1]: value for (name, labels), value in samples.items()
                        if name == f"exactspec_{kind}_tokens_by_source_total"} for kind in ("draft", "accepted")}
    assert set(by_source["accepted"]) <= COPIES and sum(by_source["accepted"].values()) > 0
    assert sum(by_source["accepted"].values()) == samples[("exactspec_accepted_tokens_total", ())]
    assert sum(by_source["draft"].values()) == samples[("exactspec_draft_tokens_total", ())]
    assert types["exactspec_accepted_tokens_by_source"] == types["exactspec_draft_tokens_by_source"] == "counter"
    rounds = [r for event in events[:-1] if "exactspec" in event for r in event["exactspec"]["rounds"]]
    accepted = sum(r["accepted"] for r in rounds if r.get("source") in COPIES)
    assert accepted == events[-2]["usage"]["speculation"]["accepted_tokens"] > 0
    assert all(r["k"] == 0 for r in rounds if "source" not in r)  # a round with no source drafted nothing


def test_every_requests_hybrid_learns_into_one_plan(tiny):  # noqa: F811
    """Requests one after another: each one's hybrid is made on the same cost model, which the earlier requests'
    offers and passes have taught (the first starts cold, each later one where the last left it), and which hears
    of each target pass once, however many requests share the pass."""
    runtime = LeanRuntime(tiny[0])
    scheduler = build_scheduler(runtime, settings(), {EOS})
    seen: list[tuple[float, int]] = []  # at each request's start: its plan's offers reached, its passes heard
    passes = []
    made, make = [], scheduler.new_proposer

    def reached(plan) -> float:
        return sum(position.reached for name, record in plan.positions.items() if name.partition("/")[0] in COPIES
                   for position in record)

    def counting(plan):
        observe = plan.observe_pass

        def observe_pass(positions: int, seconds: float) -> None:
            passes.append(positions)
            observe(positions, seconds)
        return observe_pass

    def new_proposer():
        proposer = make()
        if not made:
            proposer.plan.observe_pass = counting(proposer.plan)
        made.append(proposer)
        seen.append((reached(proposer.plan), len(passes)))
        return proposer

    scheduler.new_proposer = new_proposer
    scheduler.start()
    try:
        for prompt in PROMPTS[:2]:
            scheduler.submit(GenerationRequest(prompt_ids=prompt, max_tokens=16, stop_at_eos=False)).collect()
        steps = scheduler.metrics.steps
        together = [scheduler.submit(GenerationRequest(prompt_ids=prompt, max_tokens=16, stop_at_eos=False))
                    for prompt in PROMPTS]
        for handle in together:
            handle.collect()
        final = reached(made[0].plan)
    finally:
        scheduler.shutdown(timeout=5)
    assert len(made) == 2 + len(PROMPTS) and all(proposer.plan is made[0].plan for proposer in made)
    assert seen[0] == (0.0, 0)  # the first request starts cold
    assert 0 < seen[1][0] < final and 0 < seen[1][1]  # the second starts where the first left the plan
    assert len(passes) == scheduler.metrics.steps > steps  # one report per pass, batched or not


def test_a_hybrid_refuses_a_shared_plan_over_other_sources():
    """A plan weighs the sources it was made for: a hybrid with a draft model cannot learn into one without it."""
    from exactspec.proposers import PromptLookupProposer
    from exactspec.proposers.hybrid import HybridProposer
    from exactspec.proposers.retrieval import RetrievalProposer

    copies_only = HybridProposer([PromptLookupProposer(), RetrievalProposer(None)])
    assert HybridProposer([RetrievalProposer(None), PromptLookupProposer()], plan=copies_only.plan).plan \
        is copies_only.plan
    with pytest.raises(ValueError, match="a shared plan weighs the sources"):
        HybridProposer([PromptLookupProposer()], plan=copies_only.plan)


def test_the_hybrid_with_a_trained_head_batches_and_serves_the_tokens_of_no_drafter(tiny):  # noqa: F811
    """The hybrid with an eagle head (untrained) beside its copies, in the server: the pool keeps each slot's hidden
    states, which the head reads, the requests batch, and the greedy tokens are ``--drafter none``'s; the head drafted
    and /metrics counts it by name."""
    import copy

    from test_rounds import untrained_source
    from tiny import require_pass_invariant

    from exactspec.backends.base import SequencePool
    from exactspec.proposers.hybrid import HybridSources

    model = copy.deepcopy(tiny[0]).float()
    runtime = require_pass_invariant(LeanRuntime(model))
    plain, _, _ = served(runtime, settings("none", speculation="never"), PROMPTS, max_tokens=24)
    draft = HybridSources(None, (("eagle", untrained_source("eagle", model)),))
    answers, scheduler, made = served(runtime, settings(), PROMPTS, draft=draft, max_tokens=24)
    assert answers == plain and not isinstance(scheduler.pool, SequencePool)
    assert {name for proposer in made for name in proposer.source_names} == COPIES | {"eagle"}
    assert scheduler.metrics.draft_tokens_by_source.get("eagle", 0) > 0
