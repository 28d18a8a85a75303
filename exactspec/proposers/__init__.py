"""Drafters, one module each, all behind the :class:`Proposer` protocol, chosen by name.

A drafter is one module here: its proposer class (``name``, ``propose``, ``clear_cache``; ``propose_tree`` where it
drafts trees), ``make(target, source, datastore)``, which builds it, and, where it needs more of the target's backend
than the CausalLM protocol, ``NEEDS`` (the capability, checked before anything loads), and beside it ``ROLE``
(:class:`Role`: whether it drafts with a draft model, a datastore or trained weights), which the loading layer and
the server ask through :func:`role`. ``--drafter`` offers every such module (``choices.DRAFTERS``, read from this
folder's file names); docs/architecture.md shows how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from exactspec.backends.base import CausalLM
from exactspec.choices import DRAFTERS, check_datastore_drafter
from exactspec.errors import UsageError
from exactspec.proposers.base import EMPTY_DRAFT, Draft, Proposer, Role
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.eagle import EagleProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.mtp import MTPProposer
from exactspec.proposers.none import NoProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.retrieval import ContinuationIndex, RetrievalProposer


def drafter_module(name: str) -> ModuleType:
    """The module of --drafter ``name`` (prompt-lookup: ``prompt_lookup.py``)."""
    return importlib.import_module(f"exactspec.proposers.{name.replace('-', '_')}")


DRAFTER_MODULES = {name: drafter_module(name) for name in DRAFTERS}
# --drafter name -> make(target backend, draft source or None, retrieval datastore or None); the draft source
# (loading.draft_source) is what drafts: a CausalLM for draft-model, a trained network for mtp, eagle, early-exit
PROPOSERS: dict[str, Callable[[CausalLM, object, ContinuationIndex | None], Proposer]] = {
    name: module.make for name, module in DRAFTER_MODULES.items()}


def role(name: str) -> Role:
    """What --drafter ``name`` drafts with, as its module declares it (``ROLE``, beside ``NEEDS``; a module that
    declares neither drafts from the context alone); one line naming the drafters for any other name."""
    if name not in DRAFTER_MODULES:
        raise UsageError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_MODULES)}")
    module = DRAFTER_MODULES[name]
    return getattr(module, "ROLE", None) or Role(needs=getattr(module, "NEEDS", None))


def drafters_where(declared: Callable[[Role], bool]) -> tuple[str, ...]:
    """The drafters whose role says so (``drafters_where(lambda r: r.trained)``), as --drafter names them."""
    return tuple(name for name in DRAFTER_MODULES if declared(role(name)))


def takes_draft_model(name: str) -> bool:
    """Whether --drafter ``name`` drafts with a draft model that is given (--draft-model PATH): one that needs it,
    or one that drafts with it beside other sources (the hybrid)."""
    declared = role(name)
    return declared.needs_draft_model or declared.takes_draft_model


def finds_draft_model(name: str, trained_given: bool = False) -> bool:
    """Whether --drafter ``name``, given no draft model, drafts with the one found for it
    (``loading.found_draft_model``): one that drafts with a draft model beside other sources (the hybrid), or one
    that needs a draft model and was given no trained drafter's directory (draft-model without --drafter-path,
    which drafts as a trained one where none is found)."""
    declared = role(name)
    return declared.takes_draft_model or declared.needs_draft_model and not trained_given


def check_drafter_path(name: str, given: bool) -> None:
    """Refuse, in one line, a trained drafter's path given for a drafter that neither is trained nor takes trained
    heads beside its other sources."""
    if given and not (role(name).trained or role(name).takes_heads):
        taking = ", ".join(drafters_where(lambda r: r.trained or r.takes_heads))
        raise UsageError(f"--drafter-path is for trained drafters and the drafters that take their heads ({taking}), "
                         f"not {name}")


def make_proposer(name: str, target: CausalLM, source=None, datastore: ContinuationIndex | None = None
                  ) -> Proposer:
    """The proposer of --drafter ``name`` for ``target``, drafting with ``source`` (see PROPOSERS)."""
    role(name)  # one line for an unknown name
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
    "Role",
    "drafters_where",
    "make_proposer",
    "role",
    "takes_draft_model",
]
