"""Many sequences in one forward pass over a llama-family runtime's weights: a pool of KV-cache slots, shared below
the lean and fused runtimes' wings (each declares its pool on :class:`SlotPool`).

Each sequence owns a slot; its keys and values sit at ``pool[slot, :, :length]``. A pass takes rows (a slot, its new
tokens, how many logits it wants): the rows' tokens are packed into one matrix for every product, so the weights
stream from memory once per pass whatever the number of rows, and each query attends its own slot's positions (on
the CPU, the C kernels' attention, each query alone; elsewhere attention over all rows at once, padded to the longest
row, each query masked). Open slots are kept at the front of the pool (a closed slot takes the last one's cache), so
a pass over every open slot reads the pool as a view, with no copy.

Rollback is, as in the single-sequence runtime, only a length: positions past it are overwritten by the next pass.
"""

from __future__ import annotations

import math

import torch

from exactspec.backends import native
from exactspec.backends.base import FeaturePool, KeepsPrefixes, PoolFull, Row, Slot, SlotFeatures
from exactspec.backends.family import (
    Layer,
    added,
    attention_bias,
    blocked_attention,
    mlp,
    project_qkv,
    rms_norm,
    whole_blocks,
)
from exactspec.backends.linear import Linear
from exactspec.backends.sequence import LlamaSequence
from exactspec.cores import beyond_memory


class SlotPool(FeaturePool, KeepsPrefixes, SlotFeatures):
    """KV caches for up to ``max_slots`` sequences of up to ``max_length`` tokens, all extended in one pass. The
    runtime's wing declares how a pass's rows run (:meth:`run_rows`), which LM head reads them (:meth:`head_for`)
    and the fewest new tokens a row runs as a prompt's (``prompt_positions``); :meth:`torch_rows` runs them in
    PyTorch."""

    prompt_positions: int

    def __init__(self, runtime: LlamaSequence, max_slots: int, max_length: int) -> None:
        if max_slots < 1:
            raise ValueError(f"need at least one slot, got {max_slots}")
        self.runtime = runtime
        self.device = runtime.device
        self.vocab_size = runtime.vocab_size
        self.max_length = min(max_length, runtime.max_length)
        self.max_slots = max_slots
        shape = (max_slots, runtime.kv_heads, whole_blocks(self.max_length), runtime.head_dim)  # attention reads
        # whole blocks of keys
        # torch.empty leaves pages untouched until written: memory grows with the positions actually used
        self._keys = [self._reserved(shape, runtime.dtype) for _ in range(runtime.num_layers)]
        self._values = [self._reserved(shape, runtime.dtype) for _ in range(runtime.num_layers)]
        self._cos, self._sin = runtime.rope_tables(self.max_length)  # [max_length, head_dim] each
        self._local_cos, self._local_sin = runtime.rope_tables(self.max_length, local=True) \
            if runtime.local_inv_freq is not None else (None, None)
        self.slots: list[Slot] = []  # open slots, slots[i].index == i
        # per slot index: positions below this hold finite numbers. Attention reads every row up to the pass's
        # longest; masked positions weigh 0, but 0 x NaN (never-written memory) is still NaN
        self._written = [0] * max_slots
        self.slot_floats = shape[1] * shape[2] * shape[3]  # from one slot's cache to the next
        self._features: torch.Tensor | None = None  # [max_slots, max_length, hidden] once keep_features() was called

    def _reserved(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised cache tensor, or one line where the machine cannot reserve it (``serve
        --max-batch-size 1000000`` asked for 1.5 TB: a traceback before)."""
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError):
            wanted = 2 * self.runtime.num_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            raise beyond_memory(f"a cache of {self.max_slots} slots of {self.max_length} positions", wanted,
                                "lower --max-batch-size or --max-model-len") from None

    def open(self) -> Slot:
        if len(self.slots) == self.max_slots:
            raise PoolFull(f"all {self.max_slots} slots are taken")
        slot = Slot(index=len(self.slots))
        self.slots.append(slot)
        return slot

    def close(self, slot: Slot) -> None:
        """Free the slot; the last open slot moves into its place (its cache is copied, once)."""
        last = self.slots.pop()
        if last is not slot:
            for pool in (*self._keys, *self._values):
                pool[slot.index, :, : last.length] = pool[last.index, :, : last.length]
            self._written[slot.index] = max(self._written[slot.index], last.length)
            if self._features is not None:
                self._features[slot.index, : last.length] = self._features[last.index, : last.length]
            last.index = slot.index
            self.slots[slot.index] = last
        slot.index = -1

    @property
    def pass_invariant(self) -> bool:
        return self.runtime.pass_invariant

    @property
    def position_bytes(self) -> int:
        """A position's keys and values over every layer, in the cache's precision (what copy_out holds of it)."""
        runtime = self.runtime
        return 2 * runtime.num_layers * runtime.kv_heads * runtime.head_dim * self._keys[0].element_size()

    def copy_out(self, slot: Slot, length: int) -> torch.Tensor:  # [2 * layers, kv_heads, length, head_dim]
        return torch.stack([pool[slot.index, :, :length] for pool in (*self._keys, *self._values)])

    def copy_in(self, slot: Slot, kept: torch.Tensor, length: int) -> None:
        for pool, layer in zip((*self._keys, *self._values), kept):
            pool[slot.index, :, :length] = layer[:, :length]
        self._written[slot.index] = max(self._written[slot.index], length)
        slot.length = length

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:  # per row [num_logits, vocab]
        """Append every row's tokens to its slot in one pass; each row's logits at its last ``num_logits`` (and,
        where features are kept, each new position's hidden state kept in its slot)."""
        if self._features is None:
            return self.forward_hidden(rows, hidden=False)[0]
        starts = [row.slot.length for row in rows]
        logits, hidden = self.forward_hidden(rows)
        for row, start, states in zip(rows, starts, hidden):
            self._features[row.slot.index, start : start + len(states)] = states
        return logits

    def keep_features(self) -> None:
        """From now on keep each new position's final hidden state (normed, as the LM head reads it) in its slot, for
        drafters that read the target's features: one norm over every new position, not only where logits are
        wanted. A slot's positions restored from a prefix cache hold none: a server that keeps features keeps no
        prefixes."""
        if self._features is None:
            hidden = self.runtime.embed.shape[1]
            self._features = torch.empty(self.max_slots, self.max_length, hidden, dtype=self.runtime.dtype,
                                         device=self.device)

    def features(self, slot: Slot) -> torch.Tensor:  # [slot.length, hidden]
        return self._features[slot.index, : slot.length]

    @torch.inference_mode()
    def forward_hidden(self, rows: list[Row], hidden: bool = True
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """As :meth:`forward`, and (when ``hidden``) each row's final hidden states, normed as the LM head reads
        them, at every one of its new tokens: per row [num_logits, vocab] and [n, hidden]."""
        rt = self.runtime
        given, rows, layout = self._layout(rows)
        x = self.run_rows(rows, layout, rt.num_layers)
        self._advance(rows, layout)
        if hidden:
            normed = rt.final_normed(x)  # [T, hidden]
            picked = normed[layout.logit_rows]
            by_row_hidden = dict(zip((id(row) for row in rows), normed.split(layout.lengths)))
        else:
            picked = rt.final_normed(x[layout.logit_rows])  # [sum num_logits, hidden]
        logits = rt.logits(self.head_for(rows, layout), picked) if len(picked) else picked.new_empty(0, 0)
        by_row = dict(zip((id(row) for row in rows), logits.split([row.num_logits for row in rows])))
        return ([by_row[id(row)] for row in given],
                [by_row_hidden[id(row)] for row in given] if hidden else None)

    @torch.inference_mode()
    def states_after(self, rows: list[Row], layers: int) -> list[torch.Tensor]:  # per row [n, hidden]
        """Each row's hidden states (the residual stream, unnormed) after the first ``layers`` layers only, at every
        one of its new tokens. The deeper layers' caches are not written: a pool used so serves only this."""
        given, rows, layout = self._layout(rows)
        x = self.run_rows(rows, layout, layers)
        self._advance(rows, layout)
        by_row = dict(zip((id(row) for row in rows), x.split(layout.lengths)))
        return [by_row[id(row)] for row in given]

    # --- what each runtime's pool declares -------------------------------------------------------------------------

    def run_rows(self, rows: list[Row], layout: Layout, layers: int) -> torch.Tensor:  # [T, hidden]
        """The rows' packed tokens (``layout``) through the first ``layers`` layers, their keys and values written
        to their slots: the residual stream after them, in slot order."""
        raise NotImplementedError

    def head_for(self, rows: list[Row], layout: Layout) -> Linear:
        """The LM head a pass over these rows applies to their final hidden states, normed."""
        raise NotImplementedError

    # --- the pool ----------------------------------------------------------------------------------------------------

    def _layout(self, rows: list[Row]) -> tuple[list[Row], list[Row], Layout]:
        """(rows as given, rows by slot, where each packed token goes), or a refusal of rows that do not fit."""
        given, rows = rows, sorted(rows, key=lambda row: row.slot.index)
        lengths = [len(row.token_ids) for row in rows]
        if any(n == 0 for n in lengths):
            raise ValueError("a row without tokens")
        starts = [row.slot.length for row in rows]
        if any(start + n > self.max_length for start, n in zip(starts, lengths)):
            raise ValueError(f"a row would pass the pool's {self.max_length} positions")
        return given, rows, Layout(rows, starts, lengths, self.device)

    @staticmethod
    def _advance(rows: list[Row], layout: Layout) -> None:
        for row, n in zip(rows, layout.lengths):
            row.slot.length += n

    def torch_rows(self, layers: list[Layer], layout: Layout, count: int) -> torch.Tensor:  # [T, hidden]
        """:meth:`run_rows` in PyTorch through the first ``count`` of ``layers``."""
        rt = self.runtime
        if rt.row_attention:  # each query reads its own slot's keys up to its position
            layout.rows = native.RowKeys(layout.slot_of_token.numpy() * self.slot_floats, layout.positions.numpy() + 1)
        else:  # blocked attention reads whole blocks of every row's keys
            self._clear_up_to(layout.span, layout.rows_by_slot)
            layout.bias = attention_bias(layout.mask, rt.kv_heads, rt.heads // rt.kv_heads, rt.dtype)
        tables = self._cos[layout.positions], self._sin[layout.positions]  # [T, head_dim] each
        local = None if self._local_cos is None else \
            (self._local_cos[layout.positions], self._local_sin[layout.positions])
        x = rt.embedded(layout.token_ids)  # [T, hidden]
        for index, (layer, keys, values) in enumerate(zip(layers[:count], self._keys, self._values)):
            cos, sin = rt.layer_rope(index, tables, local)
            h = rms_norm(x, layer.input_norm, rt.eps)
            q, k, v = project_qkv(layer, h, cos, sin, rt.heads, rt.kv_heads, rt.head_dim, rt.eps)  # [T, *, hd]
            keys[layout.slot_of_token, :, layout.positions] = k
            values[layout.slot_of_token, :, layout.positions] = v
            attended = layer.out(self._attention(q, keys, values, layout, rt.scoring(index)))
            x = added(x, attended, layer.attn_out_norm, rt.eps)
            x = added(x, mlp(layer, x, rt.eps, rt.architecture.activation), layer.ffn_out_norm, rt.eps)
        return x

    def _clear_up_to(self, span: int, rows: list[Row]) -> None:
        """Zero the never-written positions below ``span`` of the rows' slots: the pass reads them, masked."""
        for row in rows:
            index, written = row.slot.index, self._written[row.slot.index]
            if written < span:
                for pool in (*self._keys, *self._values):
                    pool[index, :, written:span] = 0
                self._written[index] = span

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: Layout,
                   scoring: native.Scoring) -> torch.Tensor:  # [T, heads * hd]
        """Each query over its own slot's keys up to its position; keys and values: one layer's pool."""
        rt = self.runtime
        if rt.row_attention:  # the C kernels', each query alone
            return native.attention(q, keys, values, layout.rows, scoring)
        assert scoring == native.Scoring(), "blocked attention scores as llama does only"
        keys, values = layout.cached(keys), layout.cached(values)
        rows, width = len(layout.lengths), layout.width
        padded = q.new_zeros(rows * width, rt.heads, rt.head_dim)
        padded[layout.padded_index] = q
        queries = padded.view(rows, width, rt.heads, rt.head_dim).transpose(1, 2)  # [R, heads, width, hd]
        attended = blocked_attention(queries, keys, values, layout.bias)  # [R, heads, width, hd]: each row as alone
        flat = attended.transpose(1, 2).reshape(rows * width, rt.heads * rt.head_dim)
        return flat[layout.padded_index]


class Layout:
    """Where each packed token of a pass goes: its slot, position, place among the padded queries, and the mask."""

    def __init__(self, rows: list[Row], starts: list[int], lengths: list[int], device: torch.device) -> None:
        self.rows_by_slot = rows
        self.lengths = lengths
        self.total = sum(lengths)
        self.width = max(lengths)
        span = whole_blocks(max(start + n for start, n in zip(starts, lengths)))  # the blocks of keys read
        indexes = [row.slot.index for row in rows]
        self.slot_range = (indexes[0], indexes[-1] + 1) if indexes == list(range(indexes[0], indexes[-1] + 1)) \
            else None
        self.slot_tensor = torch.tensor(indexes, device=device)
        token_ids, slot_of_token, positions, padded_index, logit_rows = [], [], [], [], []
        for r, (row, start, n) in enumerate(zip(rows, starts, lengths)):
            token_ids += row.token_ids
            slot_of_token += [row.slot.index] * n
            positions += range(start, start + n)
            padded_index += range(r * self.width, r * self.width + n)
            logit_rows += range(len(token_ids) - row.num_logits, len(token_ids))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.token_ids, self.slot_of_token = as_tensor(token_ids), as_tensor(slot_of_token)
        self.positions, self.padded_index, self.logit_rows = as_tensor(positions), as_tensor(padded_index), \
            as_tensor(logit_rows)
        self.span = span
        # query i of row r (position starts[r] + i; padding queries repeat the row's last) sees keys up to it
        last_seen = torch.tensor(starts, device=device)[:, None] + torch.minimum(
            torch.arange(self.width, device=device)[None, :], torch.tensor(lengths, device=device)[:, None] - 1
        )  # [R, width]
        self.mask = torch.arange(span, device=device)[None, None, :] <= last_seen[:, :, None]  # [R, width, span]

    def cached(self, pool: torch.Tensor) -> torch.Tensor:  # [R, kv_heads, span, hd]
        """The rows' caches: a view when their slots are consecutive, else gathered."""
        if self.slot_range is not None:
            return pool[self.slot_range[0] : self.slot_range[1], :, : self.span]
        return pool[self.slot_tensor, :, : self.span]
