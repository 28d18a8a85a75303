"""Drafters, one module each, all behind the :class:`Proposer` protocol, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from specdec.backends.base import CausalLM, FeatureSource, ShallowRunner, require
from specdec.choices import DRAFTERS, check_datastore_drafter
from specdec.errors import UsageError
from specdec.proposers.base import EMPTY_DRAFT, Draft, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.early_exit import EarlyExitProposer
from specdec.proposers.mtp import MTPProposer
from specdec.proposers.none import NoProposer
from specdec.proposers.prompt_lookup import PromptLookupProposer
from specdec.proposers.retrieval import ContinuationIndex, RetrievalProposer


def _draft_model(target: CausalLM, source, datastore: ContinuationIndex | None) -> Proposer:
    if source is None:
        raise UsageError("--drafter draft-model needs a draft model: --draft-model PATH, --drafter-path DIR, or the "
                         "default target (whose trained draft model ships with specdec)")
    return DraftModelProposer(source, target_vocab_size=target.vocab_size)


# the capability each trained drafter needs of the target's backend
CAPABILITY_NEEDED = {"mtp": FeatureSource, "eagle": FeatureSource, "early-exit": ShallowRunner}


def _trained_drafter(proposer: type) -> Callable:
    """A factory for a trained drafter that reads the target's hidden states (``FeatureSource``: the engine hands
    them over) or runs its first layers (``ShallowRunner``: it holds the target)."""

    capability = CAPABILITY_NEEDED[proposer.name]

    def factory(target: CausalLM, source, datastore: ContinuationIndex | None) -> Proposer:
        require(target, capability, f"--drafter {proposer.name}", "specdec's runtime of llama-family targets is one")
        if source is None:
            raise UsageError(f"--drafter {proposer.name} needs a trained drafter (--drafter-path DIR)")
        return proposer(source, target) if capability is ShallowRunner else proposer(source)

    return factory


# --drafter name -> factory(target backend, draft source or None, retrieval datastore or None); the draft source
# (loading.draft_source) is what drafts: a CausalLM for draft-model, a trained network for mtp, eagle, early-exit
PROPOSERS: dict[str, Callable[[CausalLM, object, ContinuationIndex | None], Proposer]] = {
    "none": lambda target, source, datastore: NoProposer(),
    "prompt-lookup": lambda target, source, datastore: PromptLookupProposer(),
    "retrieval": lambda target, source, datastore: RetrievalProposer(datastore),
    "draft-model": _draft_model,
    "mtp": _trained_drafter(MTPProposer),
    "eagle": _trained_drafter(EagleProposer),
    "early-exit": _trained_drafter(EarlyExitProposer),
}
assert tuple(PROPOSERS) == DRAFTERS, "specdec.choices.DRAFTERS names every proposer, in this order"


def make_proposer(name: str, target: CausalLM, source=None, datastore: ContinuationIndex | None = None
                  ) -> Proposer:
    """The proposer of --drafter ``name`` for ``target``, drafting with ``source`` (see PROPOSERS)."""
    if name not in PROPOSERS:
        raise UsageError(f"unknown drafter {name!r}; choose from {', '.join(PROPOSERS)}")
    check_datastore_drafter(name, datastore is not None)
    return PROPOSERS[name](target, source, datastore)


__all__ = [
    "Draft",
    "DraftModelProposer",
    "EagleProposer",
    "EarlyExitProposer",
    "MTPProposer",
    "EMPTY_DRAFT",
    "NoProposer",
    "PROPOSERS",
    "PromptLookupProposer",
    "Proposer",
    "RetrievalProposer",
    "make_proposer",
]
