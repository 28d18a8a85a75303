"""specdec: exact speculative decoding of language models."""

from specdec.api import Completion, SpecDecoder
from specdec.engine import Engine, GenerationConfig, GenerationResult, GenerationStats
from specdec.errors import SpecdecError, UsageError
from specdec.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "Engine",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpecDecoder",
    "SpecdecError",
    "UsageError",
]
