"""Matrix products with the weights held in one precision, the activations in float32 on the CPU.

On the CPU every precision runs exactspec's own tiles (``native.RowProduct``: fused.c), which compute each row as it
is alone, so a row's bits never depend on how many rows share the pass, on any CPU. The libraries' kernels do on
some: on a Zen 4 EPYC a BLAS product gives a row other bits among 2 rows than among 10 (docs/exactness.md).
Where the tiles cannot run (the extension not built, a CPU without AVX2, inputs not in whole chunks of 8), the
libraries' kernels serve instead: oneDNN with weights reordered once for float32, fbgemm's packed half-precision
weights for float16, and bfloat16 weights with the activations cast around the product; the load probe then says
whether rows depend on the pass there. On CUDA every precision is a plain ``F.linear`` in that dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exactspec.backends import native

PRECISIONS = ("float32", "float16", "bfloat16")
DTYPE_OF = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
PACKED_ROWS = 5  # the row count oneDNN lays float32 weights out for: k+1 at the default k=4

Linear = Callable[[torch.Tensor], torch.Tensor]  # [n, in] -> [n, out]


def precision_name(dtype: torch.dtype) -> str:
    for name, known in DTYPE_OF.items():
        if known == dtype:
            return name
    raise ValueError(f"no precision for dtype {dtype}")


def activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """float32 on the CPU whatever the weights (float64 for float64, which tests use); the weights' dtype on CUDA."""
    return torch.float32 if device.type == "cpu" and precision != "float64" else DTYPE_OF[precision]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> Linear:  # weight [out, in]
    """``x -> x @ weight.T + bias`` with ``weight`` held in ``precision``."""
    if precision not in DTYPE_OF:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if weight.device.type != "cpu" or precision == "float64":
        return _plain(weight.to(DTYPE_OF[precision]), bias)
    if native.covers_product(weight, precision):
        return native.RowProduct(weight, bias, precision)
    bias32 = None if bias is None else bias.float()
    if precision == "float32":
        return _onednn(weight.float(), bias32) if _has_onednn() else _plain(weight.float(), bias32)
    if precision == "float16" and has_fbgemm():
        return _fbgemm_half(weight.float(), bias32)
    return _cast_around(weight.to(DTYPE_OF[precision]), bias32)


def _plain(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return lambda x: F.linear(x, weight, bias)


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """oneDNN's product over reordered weights. One row goes through as two (itself twice): oneDNN's one-row path
    sums some products (the down projection's, 1536 long) in another order than its path for several rows, so a
    position's output would depend on the pass; two rows cost what one does."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_ROWS)

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.repeat(2, 1), packed, bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return linear


def _fbgemm_half(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    with warnings.catch_warnings():  # deprecated in PyTorch (it warns once), and its fastest half-weight CPU kernel
        warnings.simplefilter("ignore")
        packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.contiguous())
        torch.fbgemm_linear_fp16_weight_fp32_activation(weight.new_zeros(1, weight.shape[1]), packed, bias)
    return lambda x: torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, bias)


def _cast_around(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(weight.dtype), weight).float()
        return out if bias is None else out + bias

    return linear


def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def has_fbgemm() -> bool:
    return hasattr(torch, "fbgemm_pack_gemm_matrix_fp16") and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


BULK_POSITIONS = 32  # a pass over this many positions or more is a bulk pass: prefill, a large batch


@dataclass(frozen=True)
class PassPrecisions:
    """The weight precision of each kind of target pass.

    ``decode`` runs one position (plain decoding, a round with an empty draft, a draft model's steps); ``score``
    runs several (verifying k+1 positions, a small batch); ``bulk`` runs ``BULK_POSITIONS`` or more (prefill, a
    large batch), where arithmetic rather than weight streaming sets the pace, and so may favour another kernel;
    it defaults to ``score``. Tokens are drawn from the distributions that the pass which emits them computes:
    with different precisions, speculative, batched and plain decoding may part at near-ties.
    """

    decode: str
    score: str
    bulk: str = ""

    def __post_init__(self) -> None:
        if not self.bulk:
            object.__setattr__(self, "bulk", self.score)

    @classmethod
    def uniform(cls, precision: str) -> PassPrecisions:
        return cls(decode=precision, score=precision, bulk=precision)

    def for_positions(self, positions: int) -> str:
        """The precision of a pass over this many positions."""
        return self.decode if positions == 1 else self.score if positions < BULK_POSITIONS else self.bulk

    @property
    def all(self) -> tuple[str, ...]:
        return (self.decode, self.score, self.bulk)

    def __str__(self) -> str:
        if self.decode == self.score == self.bulk:
            return self.decode
        text = f"decode {self.decode}, score {self.score}"
        return text if self.bulk == self.score else f"{text}, bulk {self.bulk}"
