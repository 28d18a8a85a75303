"""The ``retrieval`` drafter: the best-supported continuation of the context's longest matching suffix.

It looks in two places: a **session index** over the prompt and the text generated so far, updated by each new
token, and optionally a **datastore** built from a corpus (``specdec datastore build``). Both map a suffix of up to
``max_order`` tokens to the token that most often followed it (its *support* is how often). The draft is grown one
token at a time: at each step the longest suffix (of the context and the draft so far) that either index knows
gives the next token; the session comes first, being about this very text. Drafting stops where no suffix of at
least ``min_order`` tokens is known.

Costs: indexing a token touches ``max_order`` entries; a proposal makes at most ``k x max_order`` lookups per
index. Neither grows with the length of the context. The draft is a point mass, so exactness never depends on
how good it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec.proposers.base import EMPTY_DRAFT, Draft, TreeProposer, trie_draft
from specdec.sampling import SamplingParams

MAX_ORDER = 8  # the longest suffix matched, in tokens
MIN_ORDER = 2  # the shortest: a single token predicts its successor too poorly to be worth a draft
SYNC_CHECK = 32  # tokens compared to tell a continued context from a new one


class ContinuationIndex(Protocol):
    """Maps a suffix to the token that most often followed it."""

    max_order: int

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        """(token, support) for exactly this suffix, or None when it never occurred with a successor."""
        ...

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        """Up to ``width`` (token, support) pairs for this suffix, best first."""
        ...


class SessionIndex:
    """Suffixes of up to ``max_order`` tokens of one growing sequence, with the counts of what followed each.

    Ties in support go to the most recent successor: in text that repeats itself, the latest copy is the one
    being repeated.
    """

    def __init__(self, max_order: int = MAX_ORDER) -> None:
        self.max_order = max_order
        self.tokens: list[int] = []
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}
        self._best: dict[tuple[int, ...], tuple[int, int]] = {}  # suffix -> (token, support)

    def append(self, token: int) -> None:
        """Index ``token`` as the successor of every suffix (up to max_order long) that ends just before it."""
        tokens = self.tokens
        for n in range(1, min(self.max_order, len(tokens)) + 1):
            key = tuple(tokens[-n:])
            counts = self._counts.setdefault(key, {})
            support = counts.get(token, 0) + 1
            counts[token] = support
            best = self._best.get(key)
            if best is None or support >= best[1]:
                self._best[key] = (token, support)
        tokens.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        return self._best.get(tuple(suffix))

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        counts = self._counts.get(tuple(suffix), {})
        return sorted(counts.items(), key=lambda item: -item[1])[:width]

    def __len__(self) -> int:
        return len(self.tokens)


def continuation(indexes: Sequence[ContinuationIndex], context: Sequence[int], k: int,
                 min_order: int = MIN_ORDER, first: int | None = None) -> list[int]:
    """Up to k tokens, each the best-supported successor of the longest known suffix; ``first`` forces the first."""
    max_order = max(index.max_order for index in indexes)
    window = list(context[-max_order:])
    drafted: list[int] = []
    while len(drafted) < k:
        if first is not None and not drafted:
            token = first
        else:
            hit = _longest_match(indexes, window, min_order)
            if hit is None:
                break
            token = hit[0]
        drafted.append(token)
        window = (window + [token])[-max_order:]
    return drafted


def _longest_match(indexes: Sequence[ContinuationIndex], window: list[int], min_order: int
                   ) -> tuple[int, int] | None:
    """The first index's hit for the longest suffix of ``window`` (at most as long as the window) any index knows."""
    for n in range(len(window), min_order - 1, -1):
        suffix = window[-n:]
        for index in indexes:
            if n <= index.max_order:
                hit = index.best_next(suffix)
                if hit is not None:
                    return hit
    return None


class RetrievalProposer(TreeProposer):
    name = "retrieval"

    def __init__(self, datastore: ContinuationIndex | None = None, max_order: int = MAX_ORDER,
                 min_order: int = MIN_ORDER) -> None:
        if not 1 <= min_order <= max_order:
            raise ValueError(f"need 1 <= min_order <= max_order, got {min_order}, {max_order}")
        self.datastore = datastore
        self.max_order = max_order
        self.min_order = min_order
        self.session = SessionIndex(max_order)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
                ) -> Draft:
        if k == 0:
            return EMPTY_DRAFT
        self._follow(context)
        return Draft(tokens=continuation(self._indexes(), context, k, self.min_order))

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """Up to ``widths[0]`` continuations, each from another best-supported first token, as a tree len(widths)
        deep; the deeper widths are not used."""
        return trie_draft(self.propose_many(context, len(widths), widths[0]))

    def propose_many(self, context: list[int], k: int, width: int) -> list[list[int]]:
        """Up to ``width`` different continuations, one per best-supported first token (for token trees)."""
        self._follow(context)
        indexes = self._indexes()
        for n in range(min(len(context), self.max_order), self.min_order - 1, -1):
            firsts: dict[int, int] = {}
            for index in indexes:
                if n <= index.max_order:
                    for token, support in index.top_next(context[-n:], width):
                        firsts[token] = max(firsts.get(token, 0), support)
            if firsts:
                ranked = sorted(firsts, key=lambda t: -firsts[t])[:width]
                return [continuation(indexes, context, k, self.min_order, first=t) for t in ranked]
        return []

    def clear_cache(self) -> None:
        self.session = SessionIndex(self.max_order)

    def _indexes(self) -> list[ContinuationIndex]:
        return [self.session] + ([self.datastore] if self.datastore is not None else [])

    def _follow(self, context: list[int]) -> None:
        """Index what the context added since the last call; start over when it is another context.

        Only the last ``SYNC_CHECK`` indexed tokens are compared, so that following costs nothing per round
        whatever the length; a different context that happened to share them would only make drafts worse,
        never output different.
        """
        indexed = self.session.tokens
        n = len(indexed)
        start = max(0, n - SYNC_CHECK)
        if len(context) < n or context[start:n] != indexed[start:n]:
            self.session = SessionIndex(self.max_order)
            n = 0
        self.session.extend(context[n:])


def make(target, source, datastore: ContinuationIndex | None) -> RetrievalProposer:
    return RetrievalProposer(datastore)
