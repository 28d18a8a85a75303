"""The fused runtime's pool: many sequences' rows in one call into fused.c, each row computed as it is alone; rows
that hold a prompt run the bulk kernel (PyTorch's float32 layers) in a pass of their own, so that a row's kernel
depends on the row alone."""

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
        return self.runtime.prompt_positions  # a row of this many runs the bulk kernel

    @torch.inference_mode()
    def forward_hidden(self, rows: list[Row], hidden: bool = True
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Prompts' rows through the bulk kernel, then the others through fused.c: two passes, one answer."""
        bulk = self._bulk_rows(rows)
        if not bulk or len(bulk) == len(rows):
            return super().forward_hidden(rows, hidden)
        others = [row for row in rows if not self._runs_bulk(row)]
        answers = {}
        for part in (bulk, others):
            logits, states = super().forward_hidden(part, hidden)
            for i, row in enumerate(part):
                answers[id(row)] = (logits[i], states[i] if hidden else None)
        return [answers[id(row)][0] for row in rows], [answers[id(row)][1] for row in rows] if hidden else None

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        if self._bulk_rows(rows):
            return self.torch_rows(self.runtime.bulk_weights()[0], layout, layers)
        # one call: each packed token at its position in its slot, attending its slot's keys up to itself
        positions = layout.positions.numpy()
        return self.runtime.fused_pass(self.runtime.embedded(layout.token_ids), 0, layers, self._cache, positions,
                                       layout.slot_of_token.numpy() * self.slot_floats, positions, positions + 1)

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        return self.runtime.head_for(layout.total if self._bulk_rows(rows) else 1)

    def _bulk_rows(self, rows: list[Row]) -> list[Row]:
        """The rows the fused runtime runs on its bulk kernel (prompts)."""
        return [row for row in rows if self._runs_bulk(row)]

    def _runs_bulk(self, row: Row) -> bool:
        """Whether the row holds a prompt (with what was restored of it just before)."""
        return self.runtime.runs_as_prompt(row.restored + len(row.token_ids))
