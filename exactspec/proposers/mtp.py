"""The ``mtp`` drafter: trained multi-token-prediction heads (Medusa-style) on the target's last hidden state.

The target's feature at the last cached position already gave the pending token (the one the engine scores
next); head j maps that feature to the token j positions after it. Drafting costs no pass of any network but the
heads, and the draft is at most as long as there are heads.
"""

from __future__ import annotations

import torch

from exactspec.backends.base import FeatureSource
from exactspec.drafters.networks import MTPHeads, prepare_for_drafting
from exactspec.proposers.base import (
    EMPTY_DRAFT,
    Draft,
    FeatureProposer,
    Role,
    TreeProposer,
    draft_of,
    spine_tree,
    trained_drafter,
)
from exactspec.sampling import SamplingParams


class MTPProposer(FeatureProposer, TreeProposer):
    name = "mtp"

    def __init__(self, heads: MTPHeads) -> None:
        self.heads = prepare_for_drafting(heads.eval())

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                features: torch.Tensor) -> Draft:
        tokens, rows, _ = self._heads_draft(context, [1] * k, params, generator, features)
        return draft_of(tokens, rows)

    @torch.inference_mode()
    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None, features: torch.Tensor) -> Draft:
        """Medusa's tree, in its simplest shape: each head's choice in a chain, and beside it the head's next best
        tokens, widths[d] candidates at depth d in all."""
        tokens, rows, alternatives = self._heads_draft(context, widths, params, generator, features)
        return spine_tree(tokens, rows, alternatives) if tokens else EMPTY_DRAFT

    def _heads_draft(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None, features: torch.Tensor
                     ) -> tuple[list[int], list, list[list[int]]]:
        """Head d's token (and its distribution) for each depth d < len(widths) (at most one per head), with the
        ``widths[d] - 1`` tokens it ranks next."""
        widths = widths[: len(self.heads.heads)]
        if not widths or features.shape[0] != len(context) - 1 or len(context) < 2:
            return [], [], []
        pending = torch.tensor(context[-1], device=features.device)  # the token after the last feature
        logits = self.heads(features[-1], pending, count=len(widths))  # [k, V']
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        alternatives: list[list[int]] = []
        vocab = self.heads.vocab
        for depth, (row, width) in enumerate(zip(logits, widths)):
            token, probs = vocab.draft_token(row, params, generator, len(context) + depth)
            tokens.append(token)
            rows.append(probs)
            alternatives.append(vocab.ranked(row, width - 1, exclude=token) if width > 1 else [])
        return tokens, rows, alternatives

    def clear_cache(self) -> None:
        pass


NEEDS = FeatureSource  # of the target's backend: its hidden states, handed over by the engine
ROLE = Role(trained=True, needs=NEEDS)  # trained heads over the target's hidden states
make = trained_drafter(MTPProposer, NEEDS)
