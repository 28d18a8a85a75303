"""Model backends behind the CausalLM and Pool protocols (base.py), each runtime in its own wing: the lean runtime
for llama-family models in PyTorch (``lean/``), its fused CPU twin (``fused/``, the C source beside its Python),
llama.cpp over a GGUF file's stored weights (``llamacpp/``), and transformers as it is (``hf.py``). No wing imports
another; what they share lies below them: the llama family's PyTorch code (``family.py``), one sequence's cache
(``sequence.py``), a pool's slots (``slots.py``), products per precision (``linear.py``) and the C kernels' binding
(``native.py``). Which runtime ``--backend auto`` runs is measured (specdec/runtime_choice.py).

Nothing here imports transformers until a transformers model is wrapped: the llama.cpp path never pays for it.
"""

from __future__ import annotations

from specdec.backends.base import CausalLM, Pool, Pooled, declares, probe_pass_invariance, sync
from specdec.choices import BACKENDS
from specdec.errors import UsageError


def make_backend(model, precision: str | None = None) -> CausalLM:
    """The fastest backend that computes this transformers model: the lean runtime for llama-family models, else
    the transformers module itself.

    ``precision`` is the runtime's weight precision: None keeps the model's dtype; "auto" measures, on the CPU,
    the fastest precision for each kind of pass that keeps the target's outputs (``lean/precision.py``). The
    transformers backend runs in the model's dtype whatever is asked.
    """
    from specdec.backends.family import supports

    if not supports(model):
        from specdec.backends.hf import HFCausalLM

        return HFCausalLM(model)
    from specdec.backends.lean import LeanRuntime

    return LeanRuntime(model, _auto_precisions(model) if precision == "auto" else precision)


def pool_of(runtime: CausalLM, max_slots: int, max_length: int) -> Pool:
    """Many sequences in one pass over the runtime's weights, each in a KV-cache slot of up to ``max_length`` tokens:
    the pool the runtime declares (:class:`~specdec.backends.base.Pooled`); one line where it batches none (a
    transformers module)."""
    if not declares(runtime, Pooled):
        raise UsageError("the server runs llama-family models (llama, mistral, qwen2) on specdec's lean or fused "
                         "runtime, or a GGUF file on llama.cpp")
    return runtime.pool(max_slots, max_length)


def runtime_class(backend: str) -> type:
    """The class that runs a settled ``--backend`` (lean, fused, llama.cpp): what it declares can be asked before
    anything loads."""
    import importlib

    wing, name = {"lean": ("lean", "LeanRuntime"), "fused": ("fused", "FusedRuntime"),
                  "llama.cpp": ("llamacpp", "LlamaCppLM")}[backend]
    return getattr(importlib.import_module(f"specdec.backends.{wing}"), name)


def runtime_of(loaded, precision: str | None = None) -> CausalLM:
    """The backend that runs a loaded model: llama.cpp's runtime where it was loaded on llama.cpp, the fused runtime
    where it was loaded for it (its own weights, whatever ``precision``), else one built from its transformers module
    (``make_backend``)."""
    if loaded.runtime is not None:
        return loaded.runtime
    if loaded.backend == "fused":
        from specdec.backends.fused import FusedRuntime

        return FusedRuntime(loaded.model, gguf=loaded.gguf)
    return make_backend(loaded.model, precision)


def target_backend(loaded, precision: str | None = None) -> CausalLM:
    """``runtime_of`` a target, probed for pass invariance as it loads: the target's rows decide every token, so
    one line says where they depend on the pass, and what makes them not (a drafter's rows decide none). Each
    runtime names what computes its rows and that remedy itself (``runtime_label``, ``remedy``)."""
    backend = runtime_of(loaded, precision)
    probe_pass_invariance(backend, loaded.path.name, backend.runtime_label, backend.remedy(loaded.path))
    return backend


def precision_of(backend: CausalLM) -> str:
    """The weights' precision a backend runs in, as it declares it: per kind of pass on the lean runtime, the
    GGUF's stored type on llama.cpp, else the model's dtype."""
    return backend.precision_label


def _auto_precisions(model):
    if next(model.parameters()).device.type != "cpu":
        return None  # on CUDA the model's own dtype, as loaded
    from specdec.backends.lean.precision import auto_precisions

    return auto_precisions(model)


# class -> module
_LAZY = {"FusedRuntime": "fused", "HFCausalLM": "hf", "LeanRuntime": "lean", "PassPrecisions": "linear"}


def __getattr__(name: str):  # the runtimes' classes, imported when first asked for (submodules import as usual)
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"specdec.backends.{_LAZY[name]}"), name)


__all__ = ["BACKENDS", "CausalLM", "FusedRuntime", "HFCausalLM", "LeanRuntime", "PassPrecisions", "Pool",
           "make_backend", "pool_of", "precision_of", "runtime_of", "sync", "target_backend"]
