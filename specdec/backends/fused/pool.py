"""The fused runtime's pool: many sequences' rows in one call into fused.c (a prompt's many rows in several), each
row computed as it is alone: a prompt's rows, a round's and a step's are the same bits in any company."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.backends.base import Row
from specdec.backends.fused.cache import PassCache
from specdec.backends.linear import Linear
from specdec.backends.slots import Layout, SlotPool

if TYPE_CHECKING:
    from specdec.backends.fused.runtime import FusedRuntime


class FusedPool(SlotPool):
    """:class:`SlotPool` over a :class:`FusedRuntime`'s weights, read through fused.c."""

    runtime: FusedRuntime

    def __init__(self, runtime: FusedRuntime, max_slots: int, max_length: int) -> None:
        super().__init__(runtime, max_slots, max_length)
        self._cache = PassCache(self._keys, self._values, self.slot_floats // runtime.kv_heads, self._cos, self._sin,
                                self._local_cos, self._local_sin)

    @property
    def prompt_positions(self) -> int:
        return self.runtime.prompt_positions  # a row of this many counts as a prompt's (the runtime's count)

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        """Each packed token at its position in its slot, attending its slot's keys up to itself, through fused.c:
        one call, or a prompt's many tokens the runtime's prompt_chunk a call (each row computed alone: the same
        bits)."""
        x, positions = self.runtime.embedded(layout.token_ids), layout.positions.numpy()
        bases = layout.slot_of_token.numpy() * self.slot_floats
        step = self.runtime.prompt_chunk
        chunks = [slice(at, at + step) for at in range(0, len(positions), step)]
        return torch.cat([self.runtime.fused_pass(x[c], 0, layers, self._cache, positions[c], bases[c], positions[c],
                                                  positions[c] + 1) for c in chunks])

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        return self.runtime.head_for(layout.total)
