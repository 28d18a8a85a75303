"""The ``mtp`` drafter: trained multi-token-prediction heads (Medusa-style) on the target's last hidden state.

The target's feature at the last cached position already gave the pending token (the one the engine scores
next); head j maps that feature to the token j positions after it. Drafting costs no pass of any network but the
heads, and the draft is at most as long as there are heads.
"""

from __future__ import annotations

import torch

from specdec.drafters.networks import MTPHeads, prepare_for_drafting
from specdec.proposers.base import EMPTY_DRAFT, Draft, draft_of
from specdec.sampling import SamplingParams


class MTPProposer:
    name = "mtp"

    def __init__(self, heads: MTPHeads, target) -> None:
        target.keep_hidden_states()
        self.heads = prepare_for_drafting(heads.eval())
        self.target = target

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
                ) -> Draft:
        features = self.target.hidden_states  # [len(context)-1, hidden]
        k = min(k, len(self.heads.heads))
        if k == 0 or features.shape[0] != len(context) - 1 or len(context) < 2:
            return EMPTY_DRAFT
        logits = self.heads(features[-1], count=k)  # [k, V']
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        for row in logits:
            token, probs = self.heads.vocab.draft_token(row, params, generator)
            tokens.append(token)
            rows.append(probs)
        return draft_of(tokens, rows)

    def clear_cache(self) -> None:
        pass
