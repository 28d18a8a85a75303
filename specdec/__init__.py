"""specdec: exact speculative decoding of language models.

The names below load on first use, so that ``import specdec`` (and ``specdec --help``) do not import torch.
"""

import importlib

__version__ = "0.1.0"

_HOMES = {
    "Completion": "specdec.api",
    "SpecDecoder": "specdec.api",
    "Engine": "specdec.engine",
    "GenerationConfig": "specdec.engine",
    "GenerationResult": "specdec.engine",
    "GenerationStats": "specdec.engine",
    "SamplingParams": "specdec.sampling",
    "SpecdecError": "specdec.errors",
    "UsageError": "specdec.errors",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
