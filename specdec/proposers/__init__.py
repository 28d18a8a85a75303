"""Drafters, one module each, all behind the :class:`Proposer` protocol, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from specdec.backends.base import CausalLM
from specdec.errors import UsageError
from specdec.proposers.base import EMPTY_DRAFT, Draft, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.none import NoProposer
from specdec.proposers.prompt_lookup import PromptLookupProposer
from specdec.proposers.retrieval import ContinuationIndex, RetrievalProposer


def require_draft_model(drafter: str, has_draft_model: bool) -> None:
    """Refuse the draft-model drafter without a draft model (checked before anything slow is loaded)."""
    if drafter == "draft-model" and not has_draft_model:
        raise UsageError("--drafter draft-model needs --draft-model PATH")


def _draft_model(target: CausalLM, draft: CausalLM | None, datastore: ContinuationIndex | None) -> Proposer:
    require_draft_model("draft-model", draft is not None)
    return DraftModelProposer(draft, target_vocab_size=target.vocab_size)


# name -> factory(target backend, draft backend or None, retrieval datastore or None)
PROPOSERS: dict[str, Callable[[CausalLM, CausalLM | None, ContinuationIndex | None], Proposer]] = {
    "none": lambda target, draft, datastore: NoProposer(),
    "prompt-lookup": lambda target, draft, datastore: PromptLookupProposer(),
    "retrieval": lambda target, draft, datastore: RetrievalProposer(datastore),
    "draft-model": _draft_model,
}


def make_proposer(name: str, target: CausalLM, draft: CausalLM | None = None,
                  datastore: ContinuationIndex | None = None) -> Proposer:
    if name not in PROPOSERS:
        raise UsageError(f"unknown drafter {name!r}; choose from {', '.join(PROPOSERS)}")
    if datastore is not None and name != "retrieval":
        raise UsageError(f"a datastore drafts only with --drafter retrieval, not {name}")
    return PROPOSERS[name](target, draft, datastore)


__all__ = [
    "Draft",
    "DraftModelProposer",
    "EMPTY_DRAFT",
    "NoProposer",
    "PROPOSERS",
    "PromptLookupProposer",
    "Proposer",
    "RetrievalProposer",
    "make_proposer",
    "require_draft_model",
]
