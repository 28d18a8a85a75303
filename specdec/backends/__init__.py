"""Model backends behind the CausalLM protocol (base.py): a lean llama-family runtime (llama.py), its fused CPU
twin (fused.py), transformers as it is, and llama.cpp over a GGUF file's stored weights (llamacpp.py); which one
``--backend auto`` runs is measured (specdec/runtime_choice.py).

Nothing here imports transformers until a transformers model is wrapped: the llama.cpp path never pays for it.
"""

from __future__ import annotations

from specdec.backends.base import CausalLM, probe_pass_invariance, sync
from specdec.choices import BACKENDS
from specdec.errors import UsageError


def make_backend(model, precision: str | None = None) -> CausalLM:
    """The fastest backend that computes this transformers model: the lean runtime for llama-family models, else
    the transformers module itself.

    ``precision`` is the runtime's weight precision: None keeps the model's dtype; "auto" measures, on the CPU,
    the fastest precision for each kind of pass that keeps the target's outputs (``precision.py``). The
    transformers backend runs in the model's dtype whatever is asked.
    """
    from specdec.backends import llama

    if not llama.supports(model):
        from specdec.backends.hf import HFCausalLM

        return HFCausalLM(model)
    return llama.LlamaRuntime(model, _auto_precisions(model) if precision == "auto" else precision)


def pool_of(runtime: CausalLM, max_slots: int, max_length: int):
    """Many sequences in one pass over the runtime's weights, each in a KV-cache slot of up to ``max_length`` tokens:
    ``BatchedLlama`` over the torch or fused runtime, ``LlamaCppPool`` over llama.cpp's; one line where the runtime
    batches none (a transformers module)."""
    from specdec.backends.llama import LlamaRuntime
    from specdec.backends.llamacpp import LlamaCppLM, LlamaCppPool

    if isinstance(runtime, LlamaCppLM):
        return LlamaCppPool(runtime.model, max_slots, max_length, runtime.context.threads)
    if not isinstance(runtime, LlamaRuntime):
        raise UsageError("the server runs llama-family models (llama, mistral, qwen2) on specdec's runtime, or a "
                         "GGUF file on llama.cpp")
    from specdec.backends.batch import BatchedLlama

    return BatchedLlama(runtime, max_slots, max_length)


def runtime_of(loaded, precision: str | None = None) -> CausalLM:
    """The backend that runs a loaded model: llama.cpp's runtime where it was loaded on llama.cpp, the fused runtime
    where it was loaded for it (its own weights, whatever ``precision``), else one built from its transformers module
    (``make_backend``)."""
    if loaded.runtime is not None:
        return loaded.runtime
    if loaded.fused:
        from specdec.backends.fused import FusedRuntime

        return FusedRuntime(loaded.model)
    return make_backend(loaded.model, precision)


def target_backend(loaded, precision: str | None = None) -> CausalLM:
    """``runtime_of`` a target, probed for pass invariance as it loads: the target's rows decide every token, so
    one line says where they depend on the pass, and what makes them not (a drafter's rows decide none). Each
    runtime names what computes its rows and that remedy itself (``runtime_label``, ``remedy``)."""
    backend = runtime_of(loaded, precision)
    probe_pass_invariance(backend, loaded.path.name, backend.runtime_label, backend.remedy(loaded.path))
    return backend


def precision_of(backend: CausalLM) -> str:
    """The weights' precision a backend runs in, as it declares it: per kind of pass on the torch runtime, the
    GGUF's stored type on llama.cpp, else the model's dtype."""
    return backend.precision_label


def _auto_precisions(model):
    if next(model.parameters()).device.type != "cpu":
        return None  # on CUDA the model's own dtype, as loaded
    from specdec.backends.precision import auto_precisions

    return auto_precisions(model)


# class -> module
_LAZY = {"FusedRuntime": "fused", "HFCausalLM": "hf", "LlamaRuntime": "llama", "PassPrecisions": "linear"}


def __getattr__(name: str):  # the runtimes' classes, imported when first asked for (submodules import as usual)
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"specdec.backends.{_LAZY[name]}"), name)


__all__ = ["BACKENDS", "CausalLM", "FusedRuntime", "HFCausalLM", "LlamaRuntime", "PassPrecisions", "make_backend",
           "pool_of", "precision_of", "runtime_of", "sync", "target_backend"]
