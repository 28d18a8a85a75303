"""The ``none`` drafter: no draft, so every round is one plain autoregressive step of the target."""

from __future__ import annotations

import torch

from exactspec.proposers.base import EMPTY_DRAFT, Draft
from exactspec.sampling import SamplingParams


class NoProposer:
    name = "none"

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        return EMPTY_DRAFT

    def clear_cache(self) -> None:
        pass


def make(target, source, datastore) -> NoProposer:
    return NoProposer()
