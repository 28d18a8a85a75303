"""The lean runtime: a llama-family model (llama, mistral, qwen2, smollm3) run in PyTorch from the weights of a
transformers model.

What it saves over calling the transformers module: one fused product for q, k and v and one for gate and up, each
through the kernel for its weight precision (``linear.py``: on the CPU, exactspec's row kernels, which compute each row
as it is alone); a KV cache preallocated to the request (``sequence.py``); RoPE tables computed once; no per-module
Python dispatch; the LM head only where logits are needed. On the CPU the activations, norms, attention and KV cache
are float32 whatever the weights' precision, and each kind of pass (one position; several) may hold its weights in
its own precision (``--dtype auto`` measures which, ``precision.py``).
"""

from __future__ import annotations

import torch

from exactspec.backends import native
from exactspec.backends.base import Pooled, streamed_parameters
from exactspec.backends.family import FAMILIES, LINEARS, Layer, build_layers, spec_of_module, supports
from exactspec.backends.linear import BULK_POSITIONS, DTYPE_OF, Linear, PassPrecisions, activation_dtype, precision_name
from exactspec.backends.sequence import LlamaSequence


class LeanRuntime(LlamaSequence, Pooled):
    """The CausalLM protocol for llama-family models in PyTorch: every pass through :func:`build_layers`' layers
    in the precision of its kind of pass."""

    name = "lean"
    prompt_positions = BULK_POSITIONS  # a pass over this many runs in the bulk pass's precision

    def __init__(self, model, precisions: PassPrecisions | str | None = None) -> None:
        device = next(model.parameters()).device
        if precisions is None:
            precisions = precision_name(next(model.parameters()).dtype)
        if isinstance(precisions, str):
            precisions = PassPrecisions.uniform(precisions)
        dtype = activation_dtype(precisions.score, device)
        if any(activation_dtype(p, device) != dtype for p in precisions.all):
            raise ValueError(f"passes in {precisions} would need two activation dtypes on {device.type}")
        if not supports(model):
            raise ValueError(f"the lean runtime runs {', '.join(FAMILIES)} models with default RoPE")
        super().__init__(spec_of_module(model), dtype)
        self.precisions = precisions
        self.weight_bytes = streamed_parameters(model) * DTYPE_OF[precisions.decode].itemsize
        # per precision: the layers and LM head a pass in it computes with
        self._weights = {precision: build_layers(model, precision, dtype) for precision in set(precisions.all)}

    def weights_for(self, positions: int) -> tuple[list[Layer], Linear]:
        """The layers and LM head of a pass over ``positions`` new tokens, in that kind of pass's precision."""
        return self._weights[self.precisions.for_positions(positions)]

    def run_layers(self, x: torch.Tensor, first: int, end: int, start: int, positions: slice | torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden]
        return self.torch_layers(self.weights_for(x.shape[0])[0], x, first, end, start, positions, mask)

    def head_for(self, positions: int, chain: bool = True) -> Linear:
        return self.weights_for(positions)[1]

    def pool(self, max_slots: int, max_length: int):
        from exactspec.backends.lean.pool import LeanPool

        return LeanPool(self, max_slots, max_length)

    @property
    def precision_label(self) -> str:
        """The weights' precision, per kind of pass."""
        return str(self.precisions)

    @property
    def runtime_label(self) -> str:
        """What computes this runtime's rows, as a notice names it."""
        return f"exactspec's lean runtime ({self.precision_label})"

    def remedy(self, path) -> str:
        """What makes this runtime's rows the same in any pass, where they are not."""
        why = native.unavailable() or "its sizes or precision are not theirs (inputs in chunks of 8, float weights)"
        return f"exactspec's row kernels, which compute each row as it is alone, do not run here: {why}"

    @property
    def pass_invariant(self) -> bool:
        """Whether every row is computed as it is alone by construction: its products and attention are the C kernels'
        row kernels (``native``), as on any x86 CPU with AVX2 where they were built. Where they are not (CUDA, a
        missing build, float64), the libraries' kernels decide, and the load probe measures what they do."""
        linears = [linear for layers, head in self._weights.values()
                   for linear in [head] + [getattr(layer, name) for layer in layers for name in LINEARS]]
        return self.row_attention and all(isinstance(linear, native.RowProduct) for linear in linears)
