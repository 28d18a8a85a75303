"""The ``prompt-lookup`` drafter: copy what followed the latest earlier occurrence of the context's tail.

No model: the draft is a point mass. It pays where the output repeats the prompt or itself (summaries, code edits,
quoting), and costs next to nothing where it does not.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import EMPTY_DRAFT, Draft
from specdec.sampling import SamplingParams


class PromptLookupProposer:
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        if k == 0:
            return EMPTY_DRAFT
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            continuation = _continuation_of_latest_match(context, n, k)
            if continuation:
                return Draft(tokens=continuation)
        return EMPTY_DRAFT

    def clear_cache(self) -> None:
        pass


def _continuation_of_latest_match(context: list[int], n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, or []."""
    if len(context) <= n:
        return []
    tail = context[-n:]
    last = tail[-1]
    # candidate ends of an n-gram: positions before the tail's own end that hold the tail's last token
    for end in range(len(context) - 2, n - 2, -1):
        if context[end] == last and context[end - n + 1 : end + 1] == tail:
            return context[end + 1 : end + 1 + k]
    return []
