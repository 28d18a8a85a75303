"""The lean runtime's wing: llama-family models in PyTorch (``runtime.py``), its pool (``pool.py``) and
``--dtype auto``'s measurement of its precisions (``precision.py``); and what it is to the loading layer
(``KIND``): ``--backend lean``, over a transformers module on any device and in any dtype."""

from __future__ import annotations

from exactspec.backends.family import supports
from exactspec.backends.lean.runtime import LeanRuntime
from exactspec.backends.runtime_kind import RuntimeKind


def _over_model(model, gguf=None, precision: str | None = None) -> LeanRuntime | None:
    """The lean runtime over a llama-family transformers module (None for another architecture: transformers' own
    module runs it). ``precision``: None keeps the model's dtype; "auto" measures, on the CPU, the fastest
    precision for each kind of pass that keeps the target's outputs (``precision.py``)."""
    if not supports(model):
        return None
    return LeanRuntime(model, _auto_precisions(model) if precision == "auto" else precision)


def _auto_precisions(model):
    if next(model.parameters()).device.type != "cpu":
        return None  # on CUDA the model's own dtype, as loaded
    from exactspec.backends.lean.precision import auto_precisions

    return auto_precisions(model)


def _timed_precision() -> str:
    """What --backend auto times it in: float16 where fbgemm runs it, else float32 (``--dtype auto``'s usual
    choice, without measuring each precision of every candidate)."""
    from exactspec.backends.linear import has_fbgemm

    return "float16" if has_fbgemm() else "float32"


KIND = RuntimeKind(name="lean", label="exactspec's lean runtime", runtime=LeanRuntime, from_model=_over_model,
                   auto_precision=_timed_precision)

__all__ = ["KIND", "LeanRuntime"]
