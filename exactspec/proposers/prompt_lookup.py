"""The ``prompt-lookup`` drafter: copy what followed the latest earlier occurrence of the context's tail.

No model: the draft is a point mass. It pays where the output repeats the prompt or itself (summaries, code edits,
quoting), and costs next to nothing where it does not.
"""

from __future__ import annotations

import torch

from exactspec.proposers.base import EMPTY_DRAFT, Draft, GradesMatches, TreeProposer, trie_draft
from exactspec.sampling import SamplingParams


class PromptLookupProposer(TreeProposer, GradesMatches):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        tokens, _ = self.graded(context, k)
        return Draft(tokens=tokens) if tokens else EMPTY_DRAFT

    def graded(self, context: list[int], k: int) -> tuple[list[int], int]:
        """What followed the latest earlier occurrence of the longest tail that occurred before, and its length."""
        if k:
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                found = continuations_of_matches(context, n, k, 1)
                if found:
                    return found[0], n
        return [], 0

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """What followed up to ``widths[0]`` earlier occurrences of the context's tail (each with another next
        token, the latest first), as a tree len(widths) deep; the deeper widths are not used."""
        return trie_draft(self._continuations(context, len(widths), widths[0]))

    def clear_cache(self) -> None:
        pass

    def _continuations(self, context: list[int], k: int, count: int) -> list[list[int]]:
        """The continuations of the longest n-gram tail that occurred before (see ``continuations_of_matches``)."""
        if k == 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            found = continuations_of_matches(context, n, k, count)
            if found:
                return found
        return []


def continuations_of_matches(context: list[int], n: int, k: int, count: int) -> list[list[int]]:
    """Up to ``count`` continuations of up to k tokens that followed earlier occurrences of the last n tokens, the
    latest occurrence first, each starting with another token than those before it."""
    if len(context) <= n:
        return []
    tail = context[-n:]
    last = tail[-1]
    found: list[list[int]] = []
    # candidate ends of an n-gram: positions before the tail's own end that hold the tail's last token
    for end in range(len(context) - 2, n - 2, -1):
        if context[end] == last and context[end - n + 1 : end + 1] == tail:
            following = context[end + 1 : end + 1 + k]
            if all(following[0] != other[0] for other in found):
                found.append(following)
                if len(found) == count:
                    break
    return found


def make(target, source, datastore) -> PromptLookupProposer:
    return PromptLookupProposer()
