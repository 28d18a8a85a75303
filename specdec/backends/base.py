"""The model-backend protocol: weights, a KV cache over one sequence, and rollback of that cache."""

from __future__ import annotations

import time
from typing import Protocol

import torch


class CausalLM(Protocol):
    """A causal language model with a KV cache over one sequence, and the token ids that cache holds.

    ``extend`` appends tokens and returns the logits at the last ``num_logits`` of them; ``rollback`` cuts the
    cache back to a prefix, which is how rejected draft tokens are forgotten. The backend keeps ``tokens`` itself,
    so that every user of one backend (engines, benchmarks) sees the same truth about its cache.
    """

    device: torch.device
    vocab_size: int  # width of the logits
    max_length: int  # the most tokens the cache (and the model's positions) can hold
    tokens: list[int]  # the token ids in the cache, in order; read-only for callers
    weight_bytes: int  # the bytes of weights one decode pass (one position) reads: its weight-streaming cost

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Append token_ids to the cache in one forward pass; logits at the last num_logits positions."""
        ...

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens."""
        ...

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens at once, so that no later pass reallocates (a hint; may do nothing)."""
        ...


def streamed_parameters(model) -> int:
    """Parameters a one-position pass reads: all but the input embedding (of which it reads one row), unless the
    LM head shares that matrix. ``model.parameters()`` yields a shared matrix once."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - (0 if head is embed else embed.numel())


def sync(model: CausalLM, context: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
    """Make the model's cache hold exactly ``context``; logits at its last ``num_logits`` positions.

    Keeps the longest prefix shared with what is cached and re-feeds at least ``num_logits`` tokens: a request
    that extends an earlier one (the next chat turn, another sample of the same prompt) skips the shared
    prefill, and a drafter forgets its rejected draft tokens by itself.
    """
    shared = min(common_prefix_length(model.tokens, context), len(context) - num_logits)
    model.rollback(shared)
    return model.extend(context[shared:], num_logits)


def pass_seconds(model: CausalLM, positions: int) -> float:
    """Seconds of one pass over ``positions`` tokens appended to the cache, then forgotten: the cost of a decode
    pass (1) or of scoring k+1 positions. The tokens repeat the cache's last one; the cache must not be empty."""
    cached = len(model.tokens)
    started = time.perf_counter()
    model.extend(model.tokens[-1:] * positions, positions)
    elapsed = time.perf_counter() - started
    model.rollback(cached)
    return elapsed


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
