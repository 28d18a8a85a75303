"""Model backends behind the CausalLM and Pool protocols (base.py), each runtime in its own wing: the lean runtime
for llama-family models in PyTorch (``lean/``), its fused CPU twin (``fused/``, the C source beside its Python),
llama.cpp over a GGUF file's stored weights (``llamacpp/``), and transformers as it is (``hf.py``). No wing imports
another; what they share lies below them: the llama family's PyTorch code (``family.py``), one sequence's cache
(``sequence.py``), a pool's slots (``slots.py``), products per precision (``linear.py``) and the C kernels' binding
(``native.py``). Each wing declares what it is to the loading layer in its ``__init__.py`` (``KIND``, a
:class:`~exactspec.backends.runtime_kind.RuntimeKind`); :func:`kinds` gathers them. Which runtime ``--backend auto``
runs is measured (exactspec/runtime_choice.py).

Nothing here imports transformers until a transformers model is wrapped: the llama.cpp path never pays for it.
"""

from __future__ import annotations

from pathlib import Path

from exactspec.backends.base import CausalLM, Pool, Pooled, declares, probe_pass_invariance, sync
from exactspec.backends.runtime_kind import DraftGrade, RuntimeKind
from exactspec.choices import BACKENDS
from exactspec.errors import UsageError

DEFAULT = "lean"  # the runtime of any transformers module on any device and dtype: auto's choice off the CPU


def kinds() -> list[RuntimeKind]:
    """Every runtime's declaration (``KIND`` in its wing's ``__init__.py``), the default first, then by folder: a
    wing registers itself by declaring one, and the loading layer asks these, never which runtime a name is."""
    import importlib
    import pkgutil

    found = []
    for wing in pkgutil.iter_modules(__path__):
        declared = getattr(importlib.import_module(f"{__name__}.{wing.name}"), "KIND", None) if wing.ispkg else None
        if declared is not None:
            found.append(declared)
    return sorted(found, key=lambda kind: kind.name != DEFAULT)


def kind(name: str) -> RuntimeKind:
    """The runtime ``--backend name`` runs; one line naming those known for any other name."""
    known = kinds()
    for declared in known:
        if declared.name == name:
            return declared
    raise UsageError(f"unknown backend {name!r}; choose from auto, {', '.join(k.name for k in known)}")


def make_backend(model, precision: str | None = None) -> CausalLM:
    """The fastest backend that computes this transformers model: the lean runtime for llama-family models, else
    the transformers module itself.

    ``precision`` is the runtime's weight precision: None keeps the model's dtype; "auto" measures, on the CPU,
    the fastest precision for each kind of pass that keeps the target's outputs (``lean/precision.py``). The
    transformers backend runs in the model's dtype whatever is asked.
    """
    return over_model(kind(DEFAULT), model, None, precision)


def over_model(runtime: RuntimeKind, model, gguf: Path | None = None, precision: str | None = None) -> CausalLM:
    """The runtime of kind ``runtime`` over a transformers module (converted from ``gguf``, if given); where its
    code does not cover the architecture, the transformers module as it is (``hf.py``)."""
    built = runtime.from_model(model, gguf, precision)
    if built is not None:
        return built
    from exactspec.backends.hf import HFCausalLM

    return HFCausalLM(model)


def gguf_tokenizer(path: Path):
    """A GGUF file's own tokenizer, read from the file through llama.cpp (no conversion, no weights)."""
    from exactspec.backends.llamacpp import GGUFModel, GGUFTokenizer

    return GGUFTokenizer(GGUFModel(path, vocab_only=True))


def pool_of(runtime: CausalLM, max_slots: int, max_length: int) -> Pool:
    """Many sequences in one pass over the runtime's weights, each in a KV-cache slot of up to ``max_length`` tokens:
    the pool the runtime declares (:class:`~exactspec.backends.base.Pooled`); one line where it batches none (a
    transformers module)."""
    if not declares(runtime, Pooled):
        raise UsageError("the server runs llama-family models (llama, mistral, qwen2) on exactspec's lean or fused "
                         "runtime, or a GGUF file on llama.cpp")
    return runtime.pool(max_slots, max_length)


def runtime_of(loaded, precision: str | None = None) -> CausalLM:
    """The backend that runs a loaded model: the runtime read from its file where one was (llama.cpp's; the fused
    runtime's from a GGUF alone), else the one its ``--backend`` builds over its transformers module
    (``over_model``; ``precision`` as ``make_backend`` takes it)."""
    if loaded.runtime is not None:
        return loaded.runtime
    return over_model(kind(loaded.backend), loaded.model, loaded.gguf, precision)


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


# class -> module
_LAZY = {"FusedRuntime": "fused", "HFCausalLM": "hf", "LeanRuntime": "lean", "PassPrecisions": "linear"}


def __getattr__(name: str):  # the runtimes' classes, imported when first asked for (submodules import as usual)
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"exactspec.backends.{_LAZY[name]}"), name)


__all__ = ["BACKENDS", "DEFAULT", "CausalLM", "DraftGrade", "FusedRuntime", "HFCausalLM", "LeanRuntime",
           "PassPrecisions", "Pool", "RuntimeKind", "gguf_tokenizer", "kind", "kinds", "make_backend", "over_model",
           "pool_of", "precision_of", "runtime_of", "sync", "target_backend"]
