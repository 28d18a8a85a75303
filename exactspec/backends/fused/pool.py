"""The fused runtime's pool: many sequences' rows in one call into the C kernels (a prompt's many rows in several), each
row computed as it is alone: a prompt's rows, a round's and a step's are the same bits in any company."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from exactspec.backends.base import Row
from exactspec.backends.fused.cache import PassCache
from exactspec.backends.linear import Linear
from exactspec.backends.slots import Layout, SlotPool

if TYPE_CHECKING:
    from exactspec.backends.fused.runtime import FusedRuntime


class FusedPool(SlotPool):
    """:class:`SlotPool` over a :class:`FusedRuntime`'s weights, read through the C kernels."""

    runtime: FusedRuntime

    def __init__(self, runtime: FusedRuntime, max_slots: int, max_length: int) -> None:
        super().__init__(runtime, max_slots, max_length)
        self._cache = PassCache(self._keys, self._values, self.slot_floats // runtime.kv_heads, self._cos, self._sin,
                                self._local_cos, self._local_sin)

    @property
    def prompt_positions(self) -> int:
        return self.runtime.prompt_positions  # a row of this many counts as a prompt's (the runtime's count)

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        # each packed token at its position in its slot, attending its slot's keys up to itself
        positions = layout.positions.numpy()
        return self.runtime.fused_pass(self.runtime.embedded(layout.token_ids), 0, layers, self._cache, positions,
                                       layout.slot_of_token.numpy() * self.slot_floats, positions, positions + 1)

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        return self.runtime.head_for(layout.total)
