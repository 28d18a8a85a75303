"""The ``eagle`` drafter: a trained feature-level head (EAGLE-style) drafts from the target's own hidden states.

The head's position i reads the target's feature at i and the token at i+1, and predicts the target's feature at
i+1, which the target's LM head turns into the next token. It keeps a KV cache over the positions whose features
came from the target (the context); drafting past them feeds its own predicted features back, and those positions
are overwritten by the next proposal, once the target has scored them.
"""

from __future__ import annotations

import torch

from exactspec.backends.base import FeatureSource, common_prefix_length
from exactspec.drafters.layers import KVCache
from exactspec.drafters.networks import EagleHead, prepare_for_drafting
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


class EagleProposer(FeatureProposer, TreeProposer):
    name = "eagle"

    def __init__(self, head: EagleHead) -> None:
        self.head = prepare_for_drafting(head.eval())
        self._cache = KVCache(len(head.layers))
        self._fed: list[int] = []  # the tokens of the head's cached positions (the token at i+1 for position i)

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                features: torch.Tensor) -> Draft:
        spine, rows, _ = self._spine(context, [1] * k, params, generator, features)
        return draft_of(spine, rows)

    @torch.inference_mode()
    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None, features: torch.Tensor) -> Draft:
        """A tree of depth len(widths): the head's chain, and at each depth the head's next best tokens beside
        it, widths[d] candidates in all."""
        spine, rows, alternatives = self._spine(context, widths, params, generator, features)
        return spine_tree(spine, rows, alternatives) if spine else EMPTY_DRAFT

    def _spine(self, context: list[int], widths: list[int], params: SamplingParams, generator: torch.Generator | None,
               features: torch.Tensor) -> tuple[list[int], list, list[list[int]]]:
        """The head's chain of len(widths) tokens (and their distributions), with the ``widths[d] - 1`` tokens it
        ranks next at each depth."""
        n = len(context)
        if not widths or n < 2 or features.shape[0] != n - 1:
            return [], [], []
        start = min(common_prefix_length(self._fed, context[1:]), n - 2)  # re-feed at least the last position
        next_tokens = torch.tensor([context[start + 1 :]], device=features.device)  # [1, n-1-start]
        hidden = self.head(features[None, start:], next_tokens, self._cache, start)[0, -1]  # [hidden]
        self._fed = context[1:]
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        alternatives: list[list[int]] = []
        vocab = self.head.vocab
        for i, width in enumerate(widths):
            logits = vocab.logits(hidden)  # [V']
            token, probs = vocab.draft_token(logits, params, generator, n + i)
            tokens.append(token)
            rows.append(probs)
            alternatives.append(vocab.ranked(logits, width - 1, exclude=token) if width > 1 else [])
            if i < len(widths) - 1:  # the head's own feature stands in for the target's, at position n-1+i
                step = torch.tensor([[token]], device=features.device)
                hidden = self.head(hidden[None, None], step, self._cache, n - 1 + i)[0, -1]
        return tokens, rows, alternatives

    def clear_cache(self) -> None:
        self._fed = []


NEEDS = FeatureSource  # of the target's backend: its hidden states, handed over by the engine
ROLE = Role(trained=True, needs=NEEDS)  # a trained head over the target's hidden states
make = trained_drafter(EagleProposer, NEEDS)
