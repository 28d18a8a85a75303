"""The lean runtime's pool: many sequences' rows through its PyTorch layers in one pass (``slots.py``), in the
precision of a pass over that many positions."""

from __future__ import annotations

import torch

from specdec.backends.base import Row
from specdec.backends.linear import BULK_POSITIONS, Linear
from specdec.backends.slots import Layout, SlotPool


class LeanPool(SlotPool):
    """:class:`SlotPool` over a :class:`~specdec.backends.lean.runtime.LeanRuntime`'s weights."""

    prompt_positions = BULK_POSITIONS  # a pass over this many runs in the bulk pass's precision

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        return self.torch_rows(self.runtime.weights_for(layout.total)[0], layout, layers)

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        return self.runtime.weights_for(layout.total)[1]
