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

    def reset(self) -> None:
        """Forget the cached sequence."""
        ...

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Append token_ids to the cache in one forward pass; logits at the last num_logits positions."""
        ...

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens."""
        ...
