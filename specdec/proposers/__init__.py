"""Drafters, one module each, all behind the :class:`Proposer` protocol, chosen by name.

A drafter is one module here: its proposer class (``name``, ``propose``, ``clear_cache``; ``propose_tree`` where it
drafts trees), ``make(target, source, datastore)``, which builds it, and, where it needs more of the target's backend
than the CausalLM protocol, ``NEEDS`` (the capability, checked before anything loads). ``--drafter`` offers every
such module (``choices.DRAFTERS``, read from this folder's file names); docs/architecture.md shows how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from specdec.backends.base import CausalLM
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


def drafter_module(name: str) -> ModuleType:
    """The module of --drafter ``name`` (prompt-lookup: ``prompt_lookup.py``)."""
    return importlib.import_module(f"specdec.proposers.{name.replace('-', '_')}")


DRAFTER_MODULES = {name: drafter_module(name) for name in DRAFTERS}
# --drafter name -> make(target backend, draft source or None, retrieval datastore or None); the draft source
# (loading.draft_source) is what drafts: a CausalLM for draft-model, a trained network for mtp, eagle, early-exit
PROPOSERS: dict[str, Callable[[CausalLM, object, ContinuationIndex | None], Proposer]] = {
    name: module.make for name, module in DRAFTER_MODULES.items()}
# the capability a drafter needs of the target's backend, beyond CausalLM
CAPABILITY_NEEDED = {name: module.NEEDS for name, module in DRAFTER_MODULES.items() if hasattr(module, "NEEDS")}


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
