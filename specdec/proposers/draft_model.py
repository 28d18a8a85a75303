"""The ``draft-model`` drafter: a smaller causal LM that shares the target's vocabulary drafts autoregressively.

It keeps its own KV cache. Before each proposal the cache is cut back to the longest prefix it shares with the
context (:func:`sync`), so that rejected draft tokens are forgotten without the engine telling it what
happened.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.backends.base import CausalLM, sync
from specdec.errors import UsageError
from specdec.proposers.base import EMPTY_DRAFT, Draft, draft_of, draft_token
from specdec.sampling import SamplingParams


class DraftModelProposer:
    name = "draft-model"

    def __init__(self, model: CausalLM, target_vocab_size: int) -> None:
        if model.vocab_size > target_vocab_size:
            raise UsageError(
                f"the draft model's logits are wider ({model.vocab_size}) than the target's ({target_vocab_size})"
            )
        self.model = model
        self.target_vocab_size = target_vocab_size

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        if k == 0 or max(context) >= self.model.vocab_size:  # an id the draft model cannot embed
            return EMPTY_DRAFT
        logits = sync(self.model, context, num_logits=1)[0]  # [vocab_d]: rejected draft tokens are dropped here
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        for i in range(k):
            token, probs = draft_token(logits, params, generator)
            tokens.append(token)
            rows.append(None if probs is None else self._pad(probs))
            if i < k - 1:
                logits = self.model.extend([token], num_logits=1)[0]
        return draft_of(tokens, rows)

    def clear_cache(self) -> None:
        self.model.rollback(0)

    def _pad(self, probs: torch.Tensor) -> torch.Tensor:  # [vocab_d] -> [target vocab]
        """Draft probabilities over the target's logit width; ids the draft model lacks get q = 0."""
        return F.pad(probs, (0, self.target_vocab_size - probs.shape[-1]))

