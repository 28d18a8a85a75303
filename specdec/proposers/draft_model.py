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
from specdec.proposers.base import EMPTY_DRAFT, CatchesUp, Draft, TreeProposer, draft_of, spine_tree
from specdec.sampling import SamplingParams, draft_token, ranked


class DraftModelProposer(TreeProposer, CatchesUp):
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
        tokens, rows, _ = self._chain(context, [1] * k, params, generator)
        return draft_of(tokens, rows)

    def propose_tree(self, context: list[int], widths: list[int], params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
        """The draft model's chain, and beside each of its tokens the next best, widths[d] candidates at depth d."""
        tokens, rows, alternatives = self._chain(context, widths, params, generator)
        return spine_tree(tokens, rows, alternatives) if tokens else EMPTY_DRAFT

    def _chain(self, context: list[int], widths: list[int], params: SamplingParams,
               generator: torch.Generator | None) -> tuple[list[int], list, list[list[int]]]:
        """len(widths) tokens drafted autoregressively (and their distributions), with the ``widths[d] - 1`` tokens
        the draft model ranks next at each."""
        if not widths or not self._embeds(context):
            return [], [], []
        logits = sync(self.model, context, num_logits=1)[0]  # [vocab_d]: rejected draft tokens are dropped here
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        alternatives: list[list[int]] = []
        for i, width in enumerate(widths):
            token, probs = draft_token(logits, params, generator, len(context) + i)
            tokens.append(token)
            rows.append(None if probs is None else self._pad(probs))
            alternatives.append(ranked(logits, width - 1, exclude=token) if width > 1 else [])
            if i < len(widths) - 1:
                logits = self.model.extend([token], num_logits=1)[0]
        return tokens, rows, alternatives

    def catch_up(self, context: list[int]) -> None:
        if self._embeds(context):
            sync(self.model, context[:-1], num_logits=0)

    def _embeds(self, context: list[int]) -> bool:
        """Whether the draft model can embed every id of ``context`` (a wider target's may lie past its own)."""
        return max(context) < self.model.vocab_size

    def clear_cache(self) -> None:
        self.model.rollback(0)

    def _pad(self, probs: torch.Tensor) -> torch.Tensor:  # [vocab_d] -> [target vocab]
        """Draft probabilities over the target's logit width; ids the draft model lacks get q = 0."""
        return F.pad(probs, (0, self.target_vocab_size - probs.shape[-1]))


def make(target: CausalLM, source: CausalLM | None, datastore) -> DraftModelProposer:
    """A draft model's proposer: ``source`` is the draft model (loading.draft_source finds it)."""
    if source is None:
        raise UsageError("--drafter draft-model needs a draft model: --draft-model PATH, --drafter-path DIR, or the "
                         "default target (whose trained draft model ships with specdec)")
    return DraftModelProposer(source, target_vocab_size=target.vocab_size)
