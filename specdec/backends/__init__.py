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
    one line says where they depend on the pass, and what makes them not (a drafter's rows decide none)."""
    backend = runtime_of(loaded, precision)
    probe_pass_invariance(backend, loaded.path.name, *_runtime_and_remedy(backend, loaded.path))
    return backend


def _runtime_and_remedy(backend: CausalLM, path) -> tuple[str, str]:
    """What computes a backend's rows, and what makes them the same in any pass where they are not
    (docs/exactness.md)."""
    from specdec.backends.llama import LlamaRuntime
    from specdec.backends.llamacpp import LlamaCppLM

    if getattr(backend, "fused", False):
        return (f"specdec's fused runtime ({precision_of(backend)})", "none is needed: it computes each row alone")
    if isinstance(backend, LlamaCppLM):
        return (f"llama.cpp ({backend.model.weight_type} weights, this build)",
                f"`specdec quantize {path}` writes a Q8_0 copy once, and says whether its rows are the same in any "
                "pass")
    if isinstance(backend, LlamaRuntime):
        from specdec.backends import native

        why = native.unavailable() or "its sizes or precision are not theirs (inputs in chunks of 8, float weights)"
        return (f"specdec's runtime ({backend.precisions})",
                f"specdec's row kernels, which compute each row as it is alone, do not run here: {why}")
    return (f"its transformers modules ({precision_of(backend)})",
            "specdec's own runtime, which is invariant, runs llama, mistral and qwen2 models")


def precision_of(backend: CausalLM) -> str:
    """The weights' precision a backend runs in: per kind of pass on the lean runtime, the GGUF's stored type on
    llama.cpp, else the model's dtype."""
    from specdec.backends.llama import LlamaRuntime
    from specdec.backends.llamacpp import LlamaCppLM

    if getattr(backend, "fused", False):
        return f"{backend.weights} weights, fused"
    if isinstance(backend, LlamaRuntime):
        return str(backend.precisions)
    if isinstance(backend, LlamaCppLM):
        return f"{backend.model.weight_type} (GGUF, as stored)"
    return str(backend.model.dtype).removeprefix("torch.")


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
