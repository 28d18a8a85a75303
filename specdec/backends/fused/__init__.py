"""The fused runtime's wing: a llama-family pass in one call into fused.c (``runtime.py``; the C source beside it),
and its pool (``pool.py``)."""

from specdec.backends.fused.runtime import (
    PRODUCTS,
    PROMPT_POSITIONS,
    WEIGHTS,
    FusedRuntime,
    FusedUnavailable,
    gguf_unavailable,
    quantized8,
    unavailable,
)

__all__ = ["PRODUCTS", "PROMPT_POSITIONS", "WEIGHTS", "FusedRuntime", "FusedUnavailable", "gguf_unavailable",
           "quantized8", "unavailable"]
