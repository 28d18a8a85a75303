"""The ``hybrid`` drafter, the default: several sources, each round's draft from the one the cost model expects to
give the most tokens per second, or none.

Its sources: prompt lookup and the suffix index (``retrieval``: the prompt, the history and a datastore where one is
given), which copy where the text repeats itself and cost next to nothing; and a draft model where one is loaded (a
``--draft-model``, or the default model, which ships with exactspec, drafting across tokenizers for a target several
times its size: ``loading.found_draft_model``), which writes on where nothing repeats. Each round the copies offer
their continuations (free); trained heads over the target's hidden states (eagle, mtp), where given, draft as a
model does, from the features the engine hands over. :class:`SourcePlan` weighs each offer and each model against
plain decoding, from each source's acceptance per draft position, its drafting cost per token and the target's
measured pass costs. The copies are scored every round against what the target emitted, whoever drafted; a model on
its own rounds, and, while it is not chosen, on a round now and then (for at most 1/16 of the time, its catching up
counted), so that a source that stops paying is dropped and one that pays again comes back. Nothing is tuned per
kind of text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from exactspec.backends.base import declares
from exactspec.costs import SourcePlan
from exactspec.errors import UsageError
from exactspec.logs import notice
from exactspec.proposers.base import (
    EMPTY_DRAFT,
    CatchesUp,
    Combines,
    Draft,
    DraftsUnderGrammar,
    FeatureProposer,
    GradesMatches,
    Guide,
    PlansRounds,
    Proposer,
    Role,
    SharesPlan,
    TreeProposer,
)
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.retrieval import RetrievalProposer
from exactspec.sampling import SamplingParams

MAX_GRADE = 4  # a copy's matches of this many tokens and more are weighed together
SYNC_CHECK = 16  # tokens compared to tell that a context continues the one a round drafted from


class HybridProposer(TreeProposer, PlansRounds, Combines, SharesPlan, DraftsUnderGrammar):
    """Drafts from ``copies`` (drafters whose drafts cost next to nothing, proposing every round) and ``models``
    (drafters that run a network: drafting only when chosen), each named by its ``name``. ``plan``: a cost model
    over the same sources that other hybrids learn into too (a server's requests share one); None: its own."""

    name = "hybrid"
    _features = None  # the target's hidden states this round, for sources that draft from them (FeatureHybrid's)

    def __init__(self, copies: list[Proposer], models: list[Proposer] = (), plan: SourcePlan | None = None
                 ) -> None:

        self.copies = list(copies)
        self.models = list(models)
        self.source_names = tuple(source.name for source in self.copies + self.models)
        if len(set(self.source_names)) != len(self.source_names):
            raise ValueError(f"a hybrid's sources need distinct names, got {self.source_names}")
        if plan is not None and set(plan.names) != set(self.source_names):
            raise ValueError(f"a shared plan weighs the sources {plan.names}, not {self.source_names}")
        self.plan = plan if plan is not None else SourcePlan(self.source_names,
                                                             frozenset(source.name for source in self.copies))
        self._local = self.plan.local()  # this sequence's own acceptance by source (a new one's at a new context)
        self._drafted_at: dict[str, int] = {}  # per model source, the context's length when it last drafted
        self._offers: dict[str, list[int]] = {}  # the last round's offers, by source, scored at the next round
        self._offered_at: list[int] = []  # the end of the context they were drafted after (SYNC_CHECK tokens)
        self._offered_length = 0

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                guide: Guide | None = None) -> Draft:
        """Under a grammar's ``guide``, a chosen model that drafts under grammars drafts under it."""
        self._score_offers(context)
        if k == 0:
            return EMPTY_DRAFT
        offers, lengths = self._copies_offers(context, k, params, generator)
        key, length, backlog = self._choose(context, lengths, k)
        copied = key in offers  # a copy's offer, drafted k long; a model drafts the length chosen
        if key is not None and not copied:
            model = self._source(key)
            guided = {"guide": guide} if guide is not None and declares(model, DraftsUnderGrammar) else {}
            offers[key] = self._model_draft(model, context, backlog, lambda: model.propose(
                context, length, params, generator, **self._features_for(model), **guided))
        self._remember(context, {offered: draft.tokens for offered, draft in offers.items()})
        if key is None or not offers[key].tokens:
            return EMPTY_DRAFT
        chosen = offers[key].first(length) if copied else offers[key]  # a guided model's forced tokens kept
        return replace(chosen, source=_source_name(key))

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """The tree of the source the plan would choose for a chain as deep, drafted by that source."""
        self._score_offers(context)
        depth = len(widths)
        if depth == 0:
            return EMPTY_DRAFT
        chains, lengths = self._copies_offers(context, depth, params, generator)
        key, _, backlog = self._choose(context, lengths, depth)
        self._remember(context, {offered: draft.tokens for offered, draft in chains.items()})
        if key is None:
            return EMPTY_DRAFT
        source = self._source(key)
        draw = lambda: source.propose_tree(context, widths, params, generator, **self._features_for(source))  # noqa: E731
        tree = draw() if source in self.copies else self._model_draft(source, context, backlog, draw, steps=depth)
        return replace(tree, source=source.name) if tree.tokens else EMPTY_DRAFT

    def _choose(self, context: list[int], lengths: dict[str, int], k: int) -> tuple[str | None, int, int]:
        """The plan's choice (key, draft length) given what each source offers, and the chosen model's backlog (the
        tokens since it last drafted, which it catches up on first, as far as it reads them)."""
        backlogs = {model.name: self._backlog(model, context) for model in self.models}
        key, length = self.plan.choose(lengths, k, self._local, backlogs)
        return key, length, backlogs.get(key, 0)

    def _backlog(self, model: Proposer, context: list[int]) -> int:
        """The tokens ``model`` would take in before drafting after ``context``: its own count where it keeps state,
        else those since it last drafted."""
        if declares(model, CatchesUp):
            return model.backlog(context)
        return len(context) - self._drafted_at.get(model.name, 0)

    def _copies_offers(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
                       ) -> tuple[dict[str, Draft], dict[str, int]]:
        """The copies' offers, each under its key in the plan (a copy that grades its match: its name and the grade,
        ``prompt-lookup/3``), and the draft length each key offers, the models' ``k``."""
        offers: dict[str, Draft] = {}
        for source in self.copies:
            if declares(source, GradesMatches):
                tokens, grade = source.graded(context, k)
                offers[f"{source.name}/{min(grade, MAX_GRADE)}" if tokens else source.name] = Draft(tokens=tokens)
            else:
                offers[source.name] = source.propose(context, k, params, generator)
        lengths = {key: len(draft) for key, draft in offers.items()}
        lengths.update({model.name: k for model in self.models})
        return offers, lengths

    def observe_pass(self, positions: int, seconds: float) -> None:
        self.plan.observe_pass(positions, seconds)

    def clear_cache(self) -> None:
        self._offers = {}
        self._local, self._drafted_at = self.plan.local(), {}
        for source in self.copies + self.models:
            source.clear_cache()

    def _features_for(self, source: Proposer) -> dict:
        """What ``source`` drafts from beyond the context: the target's hidden states for a trained head."""
        return {"features": self._features} if declares(source, FeatureProposer) else {}

    def _source(self, key: str) -> Proposer:
        """The source a key of the plan names (a copy's graded key names the copy)."""
        name = _source_name(key)
        return next(source for source in self.copies + self.models if source.name == name)

    def _model_draft(self, model: Proposer, context: list[int], backlog: int, draw: Callable[[], Draft],
                     steps: int | None = None) -> Draft:
        """The model's draft (``draw``: a chain, or a tree ``steps`` deep), its costs measured: per draft step, and its
        catching up on the ``backlog`` tokens since it last drafted (``SourcePlan.observe_drafting``)."""
        started = time.perf_counter()
        if declares(model, CatchesUp):
            model.catch_up(context)
        caught_up = time.perf_counter()
        draft = draw()
        self.plan.observe_drafting(model.name, max(steps or len(draft), 1), time.perf_counter() - caught_up,
                                   caught_up - started, backlog)
        self._drafted_at[model.name] = len(context)
        return draft

    def _remember(self, context: list[int], offers: dict[str, list[int]]) -> None:
        self._offers = {name: tokens for name, tokens in offers.items() if tokens}
        self._offered_length = len(context)
        self._offered_at = context[-SYNC_CHECK:]

    def _score_offers(self, context: list[int]) -> None:
        """Score the last round's offers against what it emitted, where ``context`` continues the one they were
        drafted after; where it does not (another request), the sequence's own record starts again."""
        offers, self._offers = self._offers, {}
        start = self._offered_length
        if len(context) <= start or context[start - len(self._offered_at):start] != self._offered_at:
            if start:
                self._local, self._drafted_at = self.plan.local(), {}
            return
        emitted = context[start:]
        for name, tokens in offers.items():
            self.plan.observe_offer(name, tokens, emitted, self._local)


class FeatureHybridProposer(HybridProposer, FeatureProposer):
    """A hybrid with trained heads among its models: it declares that it reads the target's hidden states, which the
    engine (and the server's scheduler) then hands it each round, and it hands them on to the head that drafts."""

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                features: torch.Tensor | None = None, guide: Guide | None = None) -> Draft:
        self._features = features
        return super().propose(context, k, params, generator, guide)

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None, features: torch.Tensor | None = None) -> Draft:
        self._features = features
        return super().propose_tree(context, widths, params, generator)


@dataclass(frozen=True)
class HybridSources:
    """What a hybrid drafts with beyond its copies (``loading.draft_source`` finds them): a draft model's source (a
    runtime, or a ``ForeignDraft`` across tokenizers), or None; and trained heads, each (method, network): an eagle
    head or mtp heads over the target's hidden states."""

    model: object = None
    heads: tuple[tuple[str, object], ...] = ()


def sources_of(source) -> HybridSources:
    """``source`` as a hybrid's sources: itself, or a bare draft model's source (or None: the copies alone)."""
    return source if isinstance(source, HybridSources) else HybridSources(source)


def _source_name(key: str) -> str:
    """The source a key of the plan names: ``prompt-lookup/3`` (a copy's offers from matches of 3 tokens), or the
    source's own name."""
    return key.partition("/")[0]


# it copies from a datastore (--datastore) too, and in the server from learned answers; a draft model drafts beside
# the copies where one is given or found (the default model for a target several times its size), and trained heads
# where given (--drafter-path)
ROLE = Role(reads_datastore=True, takes_draft_model=True, takes_heads=True)


def make(target, source, datastore, plan: SourcePlan | None = None) -> HybridProposer:
    """The copies (prompt lookup; the suffix index over the context and ``datastore``), and the models among
    ``source``'s (:class:`HybridSources`, or a bare draft model's source): the draft model where there is one
    (``loading.draft_source`` finds it) and each trained head; learning into ``plan`` where one is given
    (``SharesPlan``)."""
    from exactspec.proposers import drafter_module
    from exactspec.proposers.draft_model import make as draft_model

    sources = sources_of(source)
    models = []
    if sources.model is not None:
        try:
            models.append(draft_model(target, sources.model, None))
        except UsageError as error:  # a draft model that cannot draft for this target: the copies go on alone
            notice(f"the hybrid drafts without its draft model: {error}")
    models += [drafter_module(method).make(target, network, None) for method, network in sources.heads]
    hybrid = FeatureHybridProposer if sources.heads else HybridProposer
    return hybrid([PromptLookupProposer(), RetrievalProposer(datastore)], models, plan)
