"""The ``draft-model`` drafter: a smaller causal LM that shares the target's vocabulary drafts autoregressively.

It keeps its own KV cache. Before each proposal the cache is cut back to the longest prefix it shares with the
context, so that rejected draft tokens are forgotten without the engine telling it what happened.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.backends.base import CausalLM
from specdec.errors import UsageError
from specdec.proposers.base import EMPTY_DRAFT, Draft
from specdec.sampling import SamplingParams, logits_to_probs, sample


class DraftModelProposer:
    name = "draft-model"

    def __init__(self, model: CausalLM, target_vocab_size: int) -> None:
        if model.vocab_size > target_vocab_size:
            raise UsageError(
                f"the draft model's logits are wider ({model.vocab_size}) than the target's ({target_vocab_size})"
            )
        self.model = model
        self.target_vocab_size = target_vocab_size
        self._cached: list[int] = []  # the tokens in the draft model's cache

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        if k == 0:
            return EMPTY_DRAFT
        logits = self._catch_up(context)  # [vocab_d]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, params)  # [vocab_d]
                token = sample(probs, generator)
                rows.append(probs)
            tokens.append(token)
            if i < k - 1:
                logits = self._feed([token])
        return Draft(tokens=tokens, probs=self._pad(torch.stack(rows)) if rows else None)

    def _catch_up(self, context: list[int]) -> torch.Tensor:  # [vocab_d]
        """Cut the cache back to what it shares with the context, feed the rest, return the next logits."""
        shared = _common_prefix_length(self._cached, context)
        shared = min(shared, len(context) - 1)  # feed at least one token, to get logits after the context
        self.model.rollback(shared)
        del self._cached[shared:]
        return self._feed(context[shared:])

    def _feed(self, token_ids: list[int]) -> torch.Tensor:  # [vocab_d]
        logits = self.model.extend(token_ids, num_logits=1)[0]
        self._cached += token_ids
        return logits

    def _pad(self, probs: torch.Tensor) -> torch.Tensor:  # [k, vocab_d] -> [k, target vocab]
        """Draft probabilities over the target's logit width; ids the draft model lacks get q = 0."""
        return F.pad(probs, (0, self.target_vocab_size - probs.shape[-1]))


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
