"""The ``retrieval`` drafter: the best-supported continuation of the context's longest matching suffix.

It looks in two places: a **session index** over the prompt and the text generated so far, updated by each new
token, and optionally a **datastore** built from a corpus (``exactspec datastore build``). Both map a suffix of up to
``max_order`` tokens to the token that most often followed it (its *support* is how often). The draft is grown one
token at a time: at each step the longest suffix (of the context and the draft so far) that either index knows
gives the next token; the session comes first, being about this very text. Drafting stops where no suffix of at
least ``min_order`` tokens is known.

Costs: indexing a token touches ``max_order`` entries; a proposal makes at most ``k x max_order`` lookups per
index. Neither grows with the length of the context. The draft is a point mass, so exactness never depends on
how good it is.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from exactspec.errors import UsageError
from exactspec.proposers.base import EMPTY_DRAFT, Draft, GradesMatches, Role, TreeProposer, trie_draft
from exactspec.sampling import SamplingParams

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


class SuccessorCounts:
    """Per suffix, how often each token followed it, and the best-supported one (ties: the latest counted)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}
        self._best: dict[tuple[int, ...], tuple[int, int]] = {}  # suffix -> (token, support)

    def add(self, key: tuple[int, ...], token: int) -> None:
        counts = self._counts.setdefault(key, {})
        support = counts.get(token, 0) + 1
        counts[token] = support
        best = self._best.get(key)
        if best is None or support >= best[1]:
            self._best[key] = (token, support)

    def remove(self, key: tuple[int, ...], token: int) -> None:
        """Take back one ``add(key, token)``."""
        counts = self._counts[key]
        support = counts.pop(token) - 1
        if support:
            counts[token] = support
        if not counts:
            del self._counts[key]
            del self._best[key]
        elif self._best[key][0] == token:
            self._best[key] = max(counts.items(), key=lambda item: item[1])

    def best(self, key: tuple[int, ...]) -> tuple[int, int] | None:
        return self._best.get(key)

    def top(self, key: tuple[int, ...], width: int) -> list[tuple[int, int]]:
        return sorted(self._counts.get(key, {}).items(), key=lambda item: -item[1])[:width]


class SessionIndex:
    """Suffixes of up to ``max_order`` tokens of one growing sequence, with the counts of what followed each.

    Ties in support go to the most recent successor: in text that repeats itself, the latest copy is the one
    being repeated.
    """

    def __init__(self, max_order: int = MAX_ORDER) -> None:
        self.max_order = max_order
        self.tokens: list[int] = []
        self._successors = SuccessorCounts()

    def append(self, token: int) -> None:
        """Index ``token`` as the successor of every suffix (up to max_order long) that ends just before it."""
        tokens = self.tokens
        for n in range(1, min(self.max_order, len(tokens)) + 1):
            self._successors.add(tuple(tokens[-n:]), token)
        tokens.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        return self._successors.best(tuple(suffix))

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        return self._successors.top(tuple(suffix), width)

    def __len__(self) -> int:
        return len(self.tokens)


class SharedIndex:
    """Suffixes of every document added to it (the server's finished answers, across requests), with the counts of
    what followed each, as vLLM's suffix decoding and llama.cpp's shared n-gram pool keep them. It holds at most
    ``capacity`` tokens: the oldest documents are forgotten first, their counts taken back exactly. Documents are
    added on one thread while drafts read on another: every access holds the index's lock.

    A draft from it is a point mass like every retrieval draft, so what it learned changes how much is accepted,
    never what is emitted.
    """

    FILE = "learned.npz"  # in a --datastore directory: the documents, kept across restarts

    def __init__(self, capacity: int, max_order: int = MAX_ORDER) -> None:
        if capacity < 1:
            raise UsageError(f"the shared suffix index's capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self.max_order = max_order
        self._successors = SuccessorCounts()
        self._documents: deque[list[int]] = deque()
        self.tokens = 0  # held, over all documents
        self._lock = threading.Lock()

    def add(self, document: Sequence[int]) -> None:
        """Index ``document`` (its last ``capacity`` tokens); forget the oldest documents past the capacity."""
        document = list(document[-self.capacity:])
        if len(document) < 2:
            return
        with self._lock:
            self._count(document, self._successors.add)
            self._documents.append(document)
            self.tokens += len(document)
            while self.tokens > self.capacity:
                oldest = self._documents.popleft()
                self._count(oldest, self._successors.remove)
                self.tokens -= len(oldest)

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        with self._lock:
            return self._successors.best(tuple(suffix))

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        with self._lock:
            return self._successors.top(tuple(suffix), width)

    @property
    def documents(self) -> list[list[int]]:
        with self._lock:
            return [list(d) for d in self._documents]

    def _count(self, document: list[int], count) -> None:
        """``count(suffix, successor)`` for each of the document's suffixes of MIN_ORDER to max_order tokens."""
        for i in range(MIN_ORDER, len(document)):
            for n in range(MIN_ORDER, min(self.max_order, i) + 1):
                count(tuple(document[i - n:i]), document[i])

    def save(self, directory: Path, vocab_size: int) -> Path:
        """Write the documents to ``directory`` (``FILE``), to be read back by :meth:`load`."""
        directory.mkdir(parents=True, exist_ok=True)
        documents = self.documents
        stream = np.concatenate([np.r_[np.asarray(d, dtype=np.int64), -1] for d in documents]) if documents else \
            np.zeros(0, dtype=np.int64)
        path = directory / self.FILE
        np.savez(path, tokens=stream, vocab_size=np.int64(vocab_size))
        return path

    def load(self, directory: Path, vocab_size: int) -> int:
        """Add the documents saved in ``directory`` (none if it holds no ``FILE``); how many. A file for another
        vocabulary, or a damaged one, is refused in one line."""
        path = directory / self.FILE
        if not path.is_file():
            return 0
        try:
            with np.load(path) as saved:
                stream, saved_vocab = saved["tokens"], int(saved["vocab_size"])
        except Exception as error:
            raise UsageError(f"corrupt learned suffix index at {path}: {str(error).splitlines()[0]}") from None
        if saved_vocab != vocab_size:
            raise UsageError(f"the learned suffix index at {path} is for a vocabulary of {saved_vocab} tokens; this "
                             f"model has {vocab_size}")
        documents = _split(stream.tolist())
        for document in documents:
            self.add(document)
        return len(documents)


def _split(stream: Iterable[int]) -> list[list[int]]:
    """Documents separated by -1."""
    documents, current = [], []
    for token in stream:
        if token < 0:
            documents.append(current)
            current = []
        else:
            current.append(token)
    return documents + ([current] if current else [])


class ChainedIndex:
    """Several indexes read as one: a suffix's successor from the first that knows the suffix (a request's drafter
    reads the server's shared index, then the datastore built offline)."""

    def __init__(self, indexes: Sequence[ContinuationIndex]) -> None:
        self.indexes = list(indexes)
        self.max_order = max(index.max_order for index in self.indexes)

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        for index in self.indexes:
            if len(suffix) <= index.max_order:
                hit = index.best_next(suffix)
                if hit is not None:
                    return hit
        return None

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        for index in self.indexes:
            if len(suffix) <= index.max_order:
                top = index.top_next(suffix, width)
                if top:
                    return top
        return []


def continuation(indexes: Sequence[ContinuationIndex], context: Sequence[int], k: int,
                 min_order: int = MIN_ORDER, first: int | None = None, graded: bool = False
                 ) -> list[int] | tuple[list[int], int]:
    """Up to k tokens, each the best-supported successor of the longest known suffix; ``first`` forces the first.
    ``graded``: also the length of the suffix the first token continues (0 where none, or forced)."""
    max_order = max(index.max_order for index in indexes)
    window = list(context[-max_order:])
    drafted: list[int] = []
    order = 0
    while len(drafted) < k:
        if first is not None and not drafted:
            token = first
        else:
            hit = _longest_match(indexes, window, min_order)
            if hit is None:
                break
            token, n = hit
            order = order or n
        drafted.append(token)
        window = (window + [token])[-max_order:]
    return (drafted, order) if graded else drafted


def _longest_match(indexes: Sequence[ContinuationIndex], window: list[int], min_order: int
                   ) -> tuple[int, int] | None:
    """The first index's successor for the longest suffix of ``window`` (at most as long as the window) any index
    knows, and that suffix's length."""
    for n in range(len(window), min_order - 1, -1):
        suffix = window[-n:]
        for index in indexes:
            if n <= index.max_order:
                hit = index.best_next(suffix)
                if hit is not None:
                    return hit[0], n
    return None


class RetrievalProposer(TreeProposer, GradesMatches):
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
        tokens, _ = self.graded(context, k)
        return Draft(tokens=tokens) if tokens else EMPTY_DRAFT

    def graded(self, context: list[int], k: int) -> tuple[list[int], int]:
        """The continuation, and the length of the suffix its first token continues (0 for none)."""
        if k == 0:
            return [], 0
        self._follow(context)
        tokens, order = continuation(self._indexes(), context, k, self.min_order, graded=True)
        return tokens, order

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


ROLE = Role(reads_datastore=True)  # it copies from a datastore (--datastore), and in the server from learned answers


def make(target, source, datastore: ContinuationIndex | None) -> RetrievalProposer:
    return RetrievalProposer(datastore)
