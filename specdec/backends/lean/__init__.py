"""The lean runtime's wing: llama-family models in PyTorch (``runtime.py``), its pool (``pool.py``) and
``--dtype auto``'s measurement of its precisions (``precision.py``)."""

from specdec.backends.lean.runtime import LeanRuntime

__all__ = ["LeanRuntime"]
