"""What fused.c reads of a KV cache (one sequence's, or a pool's slots): per-layer key and value bases, the stride
between kv heads, and the RoPE tables."""

from __future__ import annotations

import ctypes

import torch

from exactspec.backends.native import Cache


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class PassCache:
    """What fused.c reads of a cache: per-layer key and value bases, the stride between kv heads, RoPE tables. Holds
    the tensors it points into."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], head_stride: int, cos: torch.Tensor,
                 sin: torch.Tensor, local_cos: torch.Tensor | None = None, local_sin: torch.Tensor | None = None
                 ) -> None:
        self.tensors = (keys, values, cos, sin, local_cos, local_sin)
        pointers = ctypes.c_void_p * len(keys)
        self._keys, self._values = pointers(*[_address(k) for k in keys]), pointers(*[_address(v) for v in values])
        self.struct = Cache(self._keys, self._values, head_stride, _address(cos), _address(sin),
                            _address(local_cos), _address(local_sin))
