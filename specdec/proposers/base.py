"""The one protocol every drafter (proposer) follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Draft tokens and the distributions they were drawn from.

    ``probs`` is None for a proposer with no distribution (a copy from the context): each draft token is then a
    point mass. Greedy drafting is a point mass too.
    """

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, target vocab] or None

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(tokens=[])


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
