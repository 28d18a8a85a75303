"""exactspec: exact speculative decoding of language models.

The names below load on first use, so that ``import exactspec`` (and ``exactspec --help``) do not import torch.
"""

import importlib

__version__ = "0.1.0"

_HOMES = {
    "Completion": "exactspec.api",
    "SpecDecoder": "exactspec.api",
    "Engine": "exactspec.engine",
    "GenerationConfig": "exactspec.engine",
    "GenerationResult": "exactspec.engine",
    "GenerationStats": "exactspec.engine",
    "SamplingParams": "exactspec.sampling",
    "ExactspecError": "exactspec.errors",
    "UsageError": "exactspec.errors",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
