"""Backend for Hugging Face transformers causal LMs in PyTorch (CPU or CUDA; fp32, bf16 or fp16)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from exactspec.backends.base import streamed_parameters


class HFCausalLM:
    """A transformers causal LM with a KV cache over one sequence; rollback crops the cache."""

    name = "transformers"
    pass_invariant = False  # torch's kernels decide: the load probe measures

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.weight_bytes = streamed_parameters(model) * next(model.parameters()).element_size()
        self._cache = DynamicCache()
        self.tokens: list[int] = []

    @property
    def precision_label(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def runtime_label(self) -> str:
        return f"its transformers modules ({self.precision_label})"

    def remedy(self, path) -> str:
        return "exactspec's lean runtime, which is invariant, runs llama, mistral and qwen2 models"

    @torch.inference_mode()
    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        if not token_ids:
            return torch.empty(0, self.vocab_size, device=self.device)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(  # appends to self._cache in place
            input_ids=input_ids,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=max(num_logits, 1),  # the LM head runs only where logits are needed
        )
        self.tokens += token_ids
        return out.logits[0, out.logits.shape[1] - num_logits :]  # [num_logits, vocab]

    def rollback(self, length: int) -> None:
        if length < len(self.tokens):
            self._cache.crop(length - len(self.tokens))  # transformers 5: a negative count of tokens to remove
            del self.tokens[length:]

    def reserve(self, length: int) -> None:
        pass  # transformers' DynamicCache grows by concatenation; it has nothing to preallocate
