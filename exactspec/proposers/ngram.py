"""The ``ngram`` drafter: each draft token is the one that most often followed the context's last tokens so far.

Prompt lookup copies what followed the latest earlier occurrence of the context's tail. This drafter counts instead:
for the last n tokens (n from ``max_order`` down to 1), the successor seen most often after them anywhere in the
context (a tie: the one seen latest), then again from the tail that token makes, up to k times, as llama.cpp's
lookup decoding does from its n-gram cache. Where earlier occurrences disagree it drafts the majority's choice, and
it can chain successors seen in different places. No model: the draft is a point mass. The counts grow with the
context, one step per new token, and start again when the context is another sequence's.
"""

from __future__ import annotations

import torch

from exactspec.proposers.base import EMPTY_DRAFT, Draft
from exactspec.sampling import SamplingParams


class NgramProposer:
    name = "ngram"

    def __init__(self, max_order: int = 3) -> None:
        if max_order < 1:
            raise ValueError(f"max_order must be at least 1, got {max_order}")
        self.max_order = max_order
        self.clear_cache()

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
                ) -> Draft:
        self._count(context)
        tail, tokens = list(context[-self.max_order :]), []
        while len(tokens) < k:
            token = self._successor(tail)
            if token is None:
                break
            tokens.append(token)
            tail = (tail + [token])[-self.max_order :]
        return Draft(tokens=tokens) if tokens else EMPTY_DRAFT

    def clear_cache(self) -> None:
        self._counted: list[int] = []  # the context whose n-grams are counted
        # n-gram -> successor -> (times seen after it, the latest position it was seen at)
        self._successors: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}

    def _successor(self, tail: list[int]) -> int | None:
        """The successor seen most often after the longest n-gram ending ``tail`` that was seen at all."""
        for n in range(min(self.max_order, len(tail)), 0, -1):
            seen = self._successors.get(tuple(tail[-n:]))
            if seen:
                return max(seen, key=seen.__getitem__)
        return None

    def _count(self, context: list[int]) -> None:
        """Count the n-grams of the tokens added since the last call (all of them, for another sequence)."""
        counted = len(self._counted)
        if counted > len(context) or context[:counted] != self._counted:
            self.clear_cache()
            counted = 0
        for position in range(max(counted, 1), len(context)):
            token = context[position]
            for n in range(1, min(self.max_order, position) + 1):
                seen = self._successors.setdefault(tuple(context[position - n : position]), {})
                times, _ = seen.get(token, (0, 0))
                seen[token] = (times + 1, position)
        self._counted = list(context)


def make(target, source, datastore) -> NgramProposer:
    return NgramProposer()
