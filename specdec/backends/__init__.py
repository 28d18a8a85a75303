"""Model backends behind the CausalLM protocol (base.py): a lean llama-family runtime, and transformers as it is."""

from __future__ import annotations

from specdec.backends import llama
from specdec.backends.base import CausalLM, sync
from specdec.backends.hf import HFCausalLM
from specdec.backends.linear import PassPrecisions
from specdec.backends.llama import LlamaRuntime


def make_backend(model, precision: str | None = None) -> CausalLM:
    """The fastest backend that computes this model: the lean runtime for llama-family models, else the
    transformers module itself.

    ``precision`` is the runtime's weight precision: None keeps the model's dtype; "auto" measures, on the CPU,
    the fastest precision for each kind of pass that keeps the target's outputs (``precision.py``). The
    transformers backend runs in the model's dtype whatever is asked.
    """
    if not llama.supports(model):
        return HFCausalLM(model)
    if precision == "auto":
        return LlamaRuntime(model, _auto_precisions(model))
    return LlamaRuntime(model, precision)


def precision_of(backend: CausalLM) -> str:
    """The weight precision(s) a backend runs in: per kind of pass on the lean runtime, else the model's dtype."""
    if isinstance(backend, LlamaRuntime):
        return str(backend.precisions)
    return str(backend.model.dtype).removeprefix("torch.")


def _auto_precisions(model) -> PassPrecisions | None:
    if next(model.parameters()).device.type != "cpu":
        return None  # on CUDA the model's own dtype, as loaded
    from specdec.backends.precision import auto_precisions

    return auto_precisions(model)


__all__ = ["CausalLM", "HFCausalLM", "LlamaRuntime", "PassPrecisions", "make_backend", "precision_of", "sync"]
