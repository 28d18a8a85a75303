"""The model-backend protocol: weights, a KV cache over one sequence, and rollback of that cache."""

from __future__ import annotations

from typing import Protocol

import torch


class CausalLM(Protocol):
    """A causal language model with a KV cache over one sequence.

    The cache holds ``length`` tokens. ``extend`` appends tokens and returns the logits at the last
    ``num_logits`` of them; ``rollback`` cuts the cache back to a prefix, which is how rejected draft tokens
    are forgotten.
    """

    device: torch.device
    vocab_size: int  # width of the logits
    max_length: int  # the most tokens the cache (and the model's positions) can hold

    @property
    def length(self) -> int:
        """Number of tokens in the cache."""
        ...

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Append token_ids to the cache in one forward pass; logits at the last num_logits positions."""
        ...

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens."""
        ...


class TokenCache:
    """A backend together with the token ids its cache holds, so that a new context reuses the shared prefix.

    The engine keeps the target in one, each model drafter its draft model: a follow-up request that extends
    an earlier one (the next chat turn, the next sample of the same prompt) skips the shared prefill, and a
    drafter forgets rejected draft tokens by itself.
    """

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.tokens: list[int] = []

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        logits = self.model.extend(token_ids, num_logits)
        self.tokens += token_ids
        return logits

    def rollback(self, length: int) -> None:
        self.model.rollback(length)
        del self.tokens[length:]

    def sync(self, context: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Make the cache hold exactly ``context``; logits at its last ``num_logits`` positions.

        Keeps the longest prefix shared with what is cached, but re-feeds at least ``num_logits`` tokens.
        """
        shared = min(_common_prefix_length(self.tokens, context), len(context) - num_logits)
        self.rollback(shared)
        return self.extend(context[shared:], num_logits)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
