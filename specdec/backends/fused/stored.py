"""A GGUF's Q4_0, Q4_1 and Q8_0 weights repacked for fused.c as they are stored (``gguf_file.q8_rows``): exact, and
with no search for each block's grid (``quantized8``: 7 s of the default model's start).

Each of fused.c's matrices (a layer's q, k and v; its output; gate and up; down; the LM head) is the GGUF tensors of
those names, rows concatenated. llama.cpp's converter reorders q's and k's rows for llama models (its rotary layout);
the order that gives the transformers module's own weights, value for value, is the one taken, and a matrix whose
stored weights match the module's in no order is left to ``quantized8``.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.backends.gguf_file import Q8_STORED, GGUFFile, q8_rows

# fused.c's matrices of layer i, as GGUF tensor names: qkv, out, gate_up, down (``runtime._matrices``' order)
LAYER_TENSORS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def tensor_names(layers: int, tensors: dict) -> list[list[str]]:
    """Per fused.c matrix, the GGUF tensors whose rows make it (the LM head: ``output``, or the tied embedding)."""
    names = [[f"blk.{i}.{part}.weight" for part in parts] for i in range(layers) for parts in LAYER_TENSORS]
    return names + [["output.weight" if "output.weight" in tensors else "token_embd.weight"]]


def stored_q8(gguf: GGUFFile, names: list[str], weight: torch.Tensor, heads: int, kv_heads: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, scale, offset of the matrix the tensors ``names`` make, where each is stored as Q4_0, Q4_1 or Q8_0 and
    they hold ``weight`` [out, in] (the module's de-quantised copy) value for value; else None."""
    tensors = [gguf.tensors.get(name) for name in names]
    if any(t is None or t.type_name not in Q8_STORED for t in tensors):
        return None
    parts = [q8_rows(t) for t in tensors]
    if sum(q.shape[0] for q, _, _ in parts) != weight.shape[0] or parts[0][0].shape[1] != weight.shape[1]:
        return None
    reference = weight.detach().float().numpy()
    for orders in _row_orders(names, [q.shape[0] for q, _, _ in parts], heads, kv_heads):
        q, scale, offset = (np.concatenate([part[j][order] for part, order in zip(parts, orders)]) for j in range(3))
        values = (q.reshape(q.shape[0], -1, 32) * scale[..., None] + offset[..., None]).reshape(q.shape)
        if np.array_equal(values, reference):
            return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(offset)
    return None


def _row_orders(names: list[str], rows: list[int], heads: int, kv_heads: int) -> list[list[np.ndarray]]:
    """The row orders to try, per tensor: as stored; then with llama.cpp's q and k reordering undone."""
    stored = [np.arange(n) for n in rows]
    undone = [_unpermuted(n, heads if ".attn_q." in name else kv_heads) if ".attn_q." in name or ".attn_k." in name
              else np.arange(n) for name, n in zip(names, rows)]
    return [stored, undone]


def _unpermuted(rows: int, heads: int) -> np.ndarray:
    """The stored row that holds each of the module's rows, where llama.cpp's converter wrote each head's rows as
    its two rotary halves interleaved (``permute`` in convert_hf_to_gguf.py)."""
    written = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)  # stored <- module
    return np.argsort(written)


def module_blocks(matrices: list[torch.Tensor], source: GGUFFile, config) -> list:
    """Per fused.c matrix of a module converted from ``source``: its q, scale and offset as stored, or None."""
    names = tensor_names(config.num_hidden_layers, source.tensors)
    return [stored_q8(source, parts, matrix, config.num_attention_heads, config.num_key_value_heads)
            for parts, matrix in zip(names, matrices)]


def gguf_blocks(source: GGUFFile, layers: int, heads: int, kv_heads: int) -> list:
    """Per fused.c matrix, its q, scale and offset as the file stores them, with llama.cpp's q and k row order
    undone (a llama GGUF's: ``family.gguf_uncovered`` admits no other)."""
    matrices = []
    for parts in tensor_names(layers, source.tensors):
        tensors = [source.tensors[name] for name in parts]
        orders = _row_orders(parts, [t.shape[0] for t in tensors], heads, kv_heads)[1]
        rows = [q8_rows(t) for t in tensors]
        matrices.append(tuple(torch.from_numpy(np.concatenate([part[j][order] for part, order in zip(rows, orders)]))
                              for j in range(3)))
    return matrices
