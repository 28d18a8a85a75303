"""A trained draft LM behind the CausalLM protocol, so that the draft-model proposer drafts with it as with any
causal LM: a KV cache over one sequence, extended and rolled back."""

from __future__ import annotations

import torch

from exactspec.drafters.layers import KVCache
from exactspec.drafters.networks import DraftLM, prepare_for_drafting


class DraftLMRuntime:
    pass_invariant = False  # torch's kernels decide; a drafter's rows decide no token

    def __init__(self, network: DraftLM, max_length: int) -> None:
        self.network = prepare_for_drafting(network.eval())
        self.device = network.vocab.ids.device
        self.vocab_size = network.config.vocab_size
        self.max_length = max_length
        self.weight_bytes = 2 * (sum(p.numel() for p in network.parameters()) + network.vocab.head.numel())
        self.tokens: list[int] = []
        self._cache = KVCache(len(network.layers))

    @torch.inference_mode()
    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        vocab = self.network.vocab
        if token_ids:
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
            hidden = self.network(ids, self._cache, len(self.tokens))[0]  # [n, hidden]
            self.tokens += token_ids
        if not num_logits:  # a catch-up: the cache only
            return torch.empty(0, vocab.vocab_size, device=self.device)
        return vocab.widen(vocab.logits(hidden[len(token_ids) - num_logits :]))

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # cached positions past the length are overwritten by the next extend

    def reserve(self, length: int) -> None:
        pass  # the cache grows by doubling
