"""The one protocol every drafter (proposer) follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from exactspec.backends.base import CausalLM, ShallowRunner, require
from exactspec.errors import UsageError
from exactspec.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Draft tokens and the distributions they were drawn from.

    ``probs`` is None for a proposer with no distribution (a copy from the context): each draft token is then a
    point mass. Greedy drafting is a point mass too. Under a grammar, the first ``forced`` tokens are the ones it
    forces (point masses, accepted by construction; no drafter proposed them).
    """

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, target vocab] or None
    parents: list[int] | None = None  # a tree: each token's parent (-1: it follows the context); None: a chain
    forced: int = 0  # the leading tokens a grammar forces
    source: str = ""  # which of a combined drafter's sources drafted it (hybrid); "" for a single drafter

    @property
    def proposed(self) -> int:
        """The tokens a drafter proposed (those after the forced ones)."""
        return len(self.tokens) - self.forced

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> Draft:
        """The draft's first n tokens (their distributions, the forced ones among them, its source); a chain's."""
        if n == len(self.tokens):
            return self
        return Draft(tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n],
                     forced=min(self.forced, n), source=self.source)


EMPTY_DRAFT = Draft(tokens=[])


@dataclass(frozen=True)
class Role:
    """What a drafter drafts with beyond the context, declared in its module beside ``NEEDS`` (``ROLE``; a module
    that declares none drafts from the context alone): the loading layer, the API and the server ask it
    (``proposers.role``), never the drafter's name."""

    needs_draft_model: bool = False  # a second model drafts: --draft-model PATH on a runtime of its own, or trained
    takes_draft_model: bool = False  # a draft model drafts beside its other sources where one is given or found
    reads_datastore: bool = False  # it copies from a retrieval datastore (--datastore; the server's learned answers)
    trained: bool = False  # its weights are trained (exactspec train --method): --drafter-path DIR, or those shipped
    takes_heads: bool = False  # trained heads (eagle, mtp: --drafter-path DIR) draft beside its other sources
    needs: type | None = None  # the capability of the target's backend it needs beyond CausalLM (its NEEDS)


class Proposer(Protocol):
    """Drafts up to k tokens to follow ``context`` (prompt and everything emitted so far)."""

    name: str

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Return at most k draft tokens; fewer (or none) when the proposer has nothing good to offer."""
        ...

    def clear_cache(self) -> None:
        """Forget any state kept from earlier contexts (so that a benchmark run starts cold)."""
        ...


class CatchesUp(Protocol):
    """A proposer that keeps state per context (a draft model's KV cache), brought up to date before it drafts."""

    def catch_up(self, context: list[int]) -> None:
        """Bring the state up to ``context`` but its last tokens, which the proposal itself then feeds (at least the
        last; a draft model's first pass takes up to ``CHAIN_LEAD``, a round's accepted tokens among them). The engine
        times this apart: after rounds that drafted nothing it is a backlog of tokens, not the cost of drafting."""
        ...

    def backlog(self, context: list[int]) -> int:
        """The tokens ``catch_up(context)`` would feed the model: those past its cache's agreement with what it reads
        of ``context`` (a draft that reads a window of a long context feeds that window, not the whole)."""
        ...


class PlansRounds(Protocol):
    """A proposer that chooses each round's draft length itself (a combined drafter: which source drafts, and how
    far), from the target's pass costs it is told: the caller's policy only caps the draft and reports each pass."""

    def observe_pass(self, positions: int, seconds: float) -> None:
        """The target's pass over ``positions`` positions (the pending token and the draft) took ``seconds``."""
        ...


class GradesMatches(Protocol):
    """A drafter that copies a continuation of a suffix of the context it matched, and says how long that suffix was:
    a longer match is accepted more often, so a combined drafter weighs each grade of match apart."""

    def graded(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens copied (none where nothing matches) and the length of the suffix they continue."""
        ...


class Combines(Protocol):
    """A drafter made of several sources, each round's draft from one of them (``Draft.source`` names it)."""

    source_names: tuple[str, ...]


class SharesPlan(Protocol):
    """A drafter whose cost model (``plan``: what it has measured of its sources and of the target's passes) can
    outlive one sequence. Its module's ``make`` takes a ``plan=`` keyword: the drafter made then learns into that
    plan instead of a fresh one, so that drafters made for many sequences (a server's requests) learn together.
    What belongs to one sequence (drafts awaiting their score) stays each drafter's own."""

    plan: object


class TreeProposer(Protocol):
    """A proposer that also drafts token trees."""

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """A tree of depth len(widths), widths[d] candidates at depth d in all."""
        ...


class Guide(Protocol):
    """A grammar along a draft being drafted (``grammars.DraftGuide``): what it allows next, and what it forces
    after a token taken in."""

    def allowed(self) -> np.ndarray | None:
        """[target vocab] bool: the tokens allowed next; None where the draft must end here."""
        ...

    def take(self, token: int) -> list[int]:
        """Take in the drafted ``token``; the tokens the grammar forces after it, which follow it in the draft."""
        ...


class DraftsUnderGrammar(Protocol):
    """A drafter that drafts token by token under a grammar's :class:`Guide`, handed to ``propose`` as ``guide``
    where the sequence has a grammar: each token chosen among those allowed (its distribution renormalised over
    them, a proper q), the tokens forced after it put in the draft as point masses. Those ride outside its k, as the
    leading forced tokens do (they cost no drafting, and are accepted wherever the token before them is), within
    the room the guide gives."""

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                guide: Guide | None = None) -> Draft:
        ...


class FeatureProposer(Protocol):
    """A proposer that drafts from the target's final hidden states (normed, as its LM head reads them), handed to
    it with every call, as vLLM hands its proposers the target's hidden states: ``features`` [len(context)-1,
    hidden], one per position the target has cached (all of the context but its last token)."""

    name: str

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                features: torch.Tensor) -> Draft:
        ...

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None, features: torch.Tensor) -> Draft:
        ...


def draft_of(tokens: list[int], rows: list[torch.Tensor | None], parents: list[int] | None = None) -> Draft:
    """A Draft (a tree with ``parents``) from tokens and the distribution each came from (all None when greedy)."""
    kept = [row for row in rows if row is not None]
    return Draft(tokens=tokens, probs=torch.stack(kept) if kept else None, parents=parents)


def spine_tree(spine: list[int], rows: list[torch.Tensor | None], alternatives: list[list[int]]) -> Draft:
    """A draft tree: the drafter's chain (``spine``, each token drawn from its ``rows`` entry, None when greedy) with,
    at each depth, ``alternatives[d]`` as leaves beside the spine token: siblings fixed by the drafter's ranking (point
    masses; one-hot rows when the spine has distributions). Nodes by depth, spine first, so parents come first."""
    tokens, parents, node_rows = [], [], []
    parent = -1
    for token, row, others in zip(spine, rows, alternatives):
        spine_node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        node_rows.append(row)
        for other in others:
            tokens.append(other)
            parents.append(parent)
            node_rows.append(None if row is None else F.one_hot(torch.tensor(other, device=row.device),
                                                                row.shape[-1]).to(row.dtype))
        parent = spine_node
    return draft_of(tokens, node_rows, parents)


def trie_draft(continuations: list[list[int]]) -> Draft:
    """A draft tree of several continuations (point masses), shared prefixes merged, the earlier continuation's
    tokens first among siblings."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for continuation in continuations:
        parent = -1
        for token in continuation:
            node = node_of.get((parent, token))
            if node is None:
                node = node_of[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return Draft(tokens=tokens, parents=parents) if tokens else EMPTY_DRAFT


def trained_drafter(proposer: type, capability: type) -> Callable:
    """The ``make`` of a trained drafter that reads the target's hidden states (``FeatureSource``: the engine hands
    them over) or runs its first layers (``ShallowRunner``: it holds the target): it refuses, in one line, a target
    whose backend does not declare ``capability``, or no trained drafter."""

    def make(target: CausalLM, source, datastore) -> Proposer:
        require(target, capability, f"--drafter {proposer.name}",
                "exactspec's lean and fused runtimes of llama-family targets are")
        if source is None:
            raise UsageError(f"--drafter {proposer.name} needs a trained drafter (--drafter-path DIR)")
        return proposer(source, target) if capability is ShallowRunner else proposer(source)

    return make
