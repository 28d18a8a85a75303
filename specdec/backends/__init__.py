"""Model backends behind the CausalLM protocol (base.py): a lean llama runtime, and transformers as it is."""

from __future__ import annotations

from specdec.backends import llama
from specdec.backends.base import CausalLM, sync
from specdec.backends.hf import HFCausalLM
from specdec.backends.llama import LlamaRuntime


def make_backend(model) -> CausalLM:
    """The fastest backend that computes exactly this model: the lean runtime for llama models, else the
    transformers module itself."""
    return LlamaRuntime(model) if llama.supports(model) else HFCausalLM(model)


__all__ = ["CausalLM", "HFCausalLM", "LlamaRuntime", "make_backend", "sync"]
