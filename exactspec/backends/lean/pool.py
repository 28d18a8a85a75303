"""The lean runtime's pool: many sequences' rows through its PyTorch layers in one pass (``slots.py``), in the
precision of a pass over that many positions."""

from __future__ import annotations

import torch

from exactspec.backends.base import Row
from exactspec.backends.linear import BULK_POSITIONS, Linear
from exactspec.backends.slots import Layout, SlotPool


class LeanPool(SlotPool):
    """:class:`SlotPool` over a :class:`~exactspec.backends.lean.runtime.LeanRuntime`'s weights."""

    prompt_positions = BULK_POSITIONS  # a pass over this many runs in the bulk pass's precision

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        return self.torch_rows(self.runtime.weights_for(_positions(rows, layout))[0], layout, layers)

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        return self.runtime.weights_for(_positions(rows, layout))[1]


def _positions(rows: list[Row], layout: Layout) -> int:
    """The positions whose kind of pass this one is: its new tokens, and what was restored of their prompts."""
    return layout.total + sum(row.restored for row in rows)
