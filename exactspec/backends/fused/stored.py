"""Weight matrices as the C kernels' tiles read them (:class:`StoredMatrix`), and a GGUF's matrices repacked as they are
stored: its block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as bytes with a float scale and offset
per 32 inputs (16 for Q6_K: ``gguf_file.q8_rows``), F16 and BF16 as they are, F32 as float32. Exact, and with no
search for each block's grid (``quantized8``: 7 s of the default model's start) and no transformers module.

Each of the C pass's matrices (a layer's q, k and v; its output; gate and up; down; the LM head) is the GGUF tensors of
those names, rows concatenated, in the one format that holds each of them exactly: the finer grid where their groups
differ, float32 where they mix floats and blocks. llama.cpp's converter reorders q's and k's rows for llama models
(its rotary layout), and that is undone; qwen2's are stored in the module's order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from exactspec.backends.gguf_file import Q8_STORED, GGUFFile, Tensor, dequantized, grid_group, k_rows, q8_rows
from exactspec.backends.native import FORMAT, INTEGER_FORMAT, Matrix, group_bytes, repacked
from exactspec.errors import UsageError

# the C kernels' matrices of layer i, as GGUF tensor names: qkv, out, gate_up, down (``runtime._matrices``' order)
LAYER_TENSORS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
# phi3's files hold q, k and v in one tensor, and gate and up in one (gate's rows first)
FUSED_LAYER_TENSORS = {"phi3": (("attn_qkv",), ("attn_output",), ("ffn_up",), ("ffn_down",))}
FLOAT_STORED = {"F16": "float16", "BF16": "bfloat16"}  # kept as they are; F32, and mixtures, as float32
PERMUTED_ARCHITECTURES = ("llama", "smollm3")  # whose q and k rows llama.cpp's converter interleaved (``_unpermuted``)
CHUNK_ROWS = 8192  # rows decoded and packed at a time (a multiple of the tiles' 8)
# The GGUF types integer products keep in their own bits, and the format each is kept in: Q4_0 and Q4_1 (q under 16)
# and Q5_0 and Q5_1 (under 32), whose scales and offsets are float16 values, in 4 or 5 bits and float16; the K-quants
# in their bits under their own integer scales (gguf_file.k_rows); the format's name holds its bits (int<bits>...)
NARROW = {"Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int5", "Q5_1": "int5", "Q4_K": "int4_k", "Q5_K": "int5_k",
          "Q6_K": "int6_k"}


@dataclass
class StoredMatrix:
    """A weight matrix [outputs, inputs] as the C kernels' tiles read it: ``packed`` in ``format`` (native.FORMAT's
    names), with its bias (float32 [rows], the parts' together) or None; ``rest``: the rows after these, stored in
    another format (a matrix of GGUF tensors of two formats: a part per format), or None."""

    format: str
    outputs: int
    inputs: int
    packed: torch.Tensor
    bias: torch.Tensor | None = None
    rest: StoredMatrix | None = None

    def parts(self) -> list[StoredMatrix]:
        return [self] + (self.rest.parts() if self.rest is not None else [])

    @property
    def rows(self) -> int:
        """The outputs of all its parts."""
        return sum(part.outputs for part in self.parts())

    def struct(self, products: str = "integer") -> Matrix:
        """The C kernels' Matrix over this one's bytes (which the caller keeps alive with this object), a byte format's
        multiplied in ``products``: integer (each row's inputs quantised to bytes per block of 32, the C pass's Q8I) or
        float (each weight converted to float)."""
        return self._part_struct(products, self.bias, 0)

    def _part_struct(self, products: str, bias: torch.Tensor | None, first: int) -> Matrix:
        """This part's Matrix, its bias from row ``first`` of ``bias``, and its rest's (kept here)."""
        rest = None
        if self.rest is not None:
            held = self.rest._part_struct(products, bias, first + self.outputs)
            self.__dict__.setdefault("_rest_structs", []).append(held)  # alive while a Matrix may point at it
            rest = ctypes.addressof(held)
        if products == "integer" and self.format in INTEGER_FORMAT:
            code = INTEGER_FORMAT[self.format]
        elif self.format in FORMAT:
            code = FORMAT[self.format]
        else:
            raise ValueError(f"{self.format} weights are multiplied in integers only")
        return Matrix(code, self.inputs, self.outputs, self.packed.data_ptr(),
                      None if bias is None else bias.data_ptr() + 4 * first, rest)

    @property
    def nbytes(self) -> int:
        return sum(part.packed.numel() * part.packed.element_size() for part in self.parts())


def byte_grid(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> StoredMatrix:
    """Bytes q [out, in] with w = scale q + offset per group of 32 or 16 inputs (scale, offset float32
    [out, in / group]), packed as the C kernels' Q8 (Q8H) reads them (:func:`packed_q8`)."""
    group = q.shape[1] // scale.shape[1]
    return StoredMatrix("int8" if group == 32 else "int8_group16", q.shape[0], q.shape[1],
                        packed_q8(q, scale.float(), offset.float()))


def float_matrix(values: torch.Tensor, precision: str) -> StoredMatrix:
    """Float weights [out, in], held in ``precision``, repacked for the float tiles."""
    return StoredMatrix(precision, values.shape[0], values.shape[1], repacked(values, getattr(torch, precision)))


def packed_q8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int = 8) -> torch.Tensor:  # uint8
    """Bytes q [out, in] with w = scale q + offset per row and group of 32 (16) inputs as the C kernels' Q8 (Q8H) reads
    them: blocks of 8 rows (the last padded with zeros), each 32 inputs as 8 quads of 8 rows x 4 bytes, then the 8
    rows' scales, then their offsets, one set of 8 per group (``block_q8x8``, ``block_q8x16``). ``bits`` 4 or 5
    (q < 16 or 32, per 32, scale and offset float16 values): the quads in their bits (:func:`_quads`), the scales and
    offsets in float16 (Q4I's ``block_q4x8``, Q5I's ``block_q5x8``)."""
    rows, blocks = -(-q.shape[0] // 8) * 8, q.shape[1] // 32
    q, scale, offset = (_padded(t, rows) for t in (q, scale, offset))
    values = torch.float16 if bits in (4, 5) else torch.float32
    parts = [_quads(q, bits), _per_block(scale, blocks, values), _per_block(offset, blocks, values)]
    return torch.cat(parts, dim=-1).flatten()


def packed_k(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, d: torch.Tensor,
             dmin: torch.Tensor | None, bits: int) -> torch.Tensor:  # uint8
    """A K-quant's integers (``gguf_file.k_rows``) as the C kernels' K formats read them: per 8 rows (the last padded
    with zeros), their super-blocks of 256 inputs, each its 8 blocks' quads in ``bits`` (:func:`_quads`), then per
    block the 8 rows' integer scales (6 bits, mins None: per 16) and mins, then the rows' d and -dmin (Q4KI's
    ``super_q4k8``, Q5KI's ``super_q5k8``, Q6I's ``super_q6x8``)."""
    rows, supers = -(-q.shape[0] // 8) * 8, q.shape[1] // 256
    q, scales, d = (_padded(t, rows) for t in (q, scales, d))
    parts = [_quads(q, bits), _per_block(scales, 8 * supers, scales.dtype)]
    floats = [d]
    if mins is not None:
        parts.append(_per_block(_padded(mins, rows), 8 * supers, mins.dtype))
        floats.append(-_padded(dmin, rows))
    per_super = [part.reshape(rows // 8, supers, -1) for part in parts]  # a super-block's 8 blocks' of each
    per_super += [_per_block(t, supers, torch.float32) for t in floats]
    return torch.cat(per_super, dim=-1).flatten()


def packed_rows(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                ) -> torch.Tensor:  # uint8
    """3-bit integers q [out, in] with w = (d sc) q - (dmin mn), sc and mn [out, in / 32] (uint8) and d and dmin [out]
    (float32), as the C kernels' int3_r reads them: per 8 rows (the last padded with zeros), their d and -dmin, then
    their blocks of 32 inputs, each its quads in 3 bits (:func:`_quads`) and the 8 rows' sc, then their mn
    (``rows_q3r8``, ``block_q3r8``)."""
    rows, blocks = -(-q.shape[0] // 8) * 8, q.shape[1] // 32
    q, scales, mins, d, dmin = (_padded(t, rows) for t in (q, scales, mins, d, dmin))
    head = torch.stack([d, -dmin], dim=1).float().reshape(rows // 8, 8, 2).permute(0, 2, 1).contiguous()
    parts = [_quads(q, 3), _per_block(scales, blocks, torch.uint8), _per_block(mins, blocks, torch.uint8)]
    body = torch.cat(parts, dim=-1).reshape(rows // 8, -1)
    return torch.cat([head.view(torch.uint8).reshape(rows // 8, -1), body], dim=-1).flatten()


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t's rows, then zeros up to ``rows``."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _quads(q: torch.Tensor, bits: int) -> torch.Tensor:  # uint8 [rows / 8, blocks, bytes of a block's quads]
    """q [rows, in] (rows a multiple of 8) as blocks of 8 rows x 32 inputs, each 8 quads of 8 rows x 4 bytes (quad g:
    inputs 4g..4g+3, row j's at 4j); ``bits`` 4 (q < 16): quad 2p in the low nibbles of 32 bytes, 2p + 1 in their
    high; 5 (q < 32): the low nibbles so, then 32 bytes whose bit g is quad g's fifth bit; 6 (q < 64): the low
    nibbles so, then the top 2 bits of quad 4h + k in bits 2k, 2k + 1 of the h-th 32 bytes; 3 (q < 8): quads 2p and
    2p + 1 in bits 0-2 and 3-5 of the p-th 32 bytes (p < 3), quad 6's low 2 bits in bits 6-7 of the first and quad
    7's of the second, their third bits in bits 6 and 7 of the third."""
    rows, inputs = q.shape
    blocks = inputs // 32
    q = q.reshape(rows // 8, 8, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(rows // 8, blocks, 8, 32)
    if bits == 8:
        return q.reshape(rows // 8, blocks, -1)
    if bits == 3:
        quad = [q[:, :, g] for g in range(8)]
        planes = [quad[0] | (quad[1] << 3) | ((quad[6] & 3) << 6), quad[2] | (quad[3] << 3) | ((quad[7] & 3) << 6),
                  quad[4] | (quad[5] << 3) | ((quad[6] >> 2) << 6) | ((quad[7] >> 2) << 7)]
        return torch.cat(planes, dim=-1)
    low = q & 0x0F
    parts = [(low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(rows // 8, blocks, -1)]
    if bits == 5:
        fifth = (q >> 4) << torch.arange(8, dtype=torch.uint8)[:, None]  # [rows / 8, blocks, quad g, 32]: bit g
        parts.append(fifth.sum(dim=2, dtype=torch.uint8))  # distinct bits: their sum is their or
    if bits == 6:
        top = (q >> 4).reshape(rows // 8, blocks, 2, 4, 32)
        hi = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
        parts.append(hi.reshape(rows // 8, blocks, -1))
    return torch.cat(parts, dim=-1)


def _per_block(t: torch.Tensor, blocks: int, dtype: torch.dtype) -> torch.Tensor:  # uint8 [rows / 8, blocks, bytes]
    """t [rows, blocks * sets] in ``dtype`` as the blocks hold it: per block of 8 rows, per set, the 8 rows'."""
    rows, sets = t.shape[0], t.shape[1] // blocks
    t = t.to(dtype).reshape(rows // 8, 8, blocks, sets).permute(0, 2, 3, 1).contiguous()
    return t.view(torch.uint8).reshape(rows // 8, blocks, -1)


def tensor_names(layers: int, tensors: dict, arch: str = "llama") -> list[list[str]]:
    """Per fused.c matrix, the GGUF tensors whose rows make it (the LM head: ``output``, or the tied embedding)."""
    names = [[f"blk.{i}.{part}.weight" for part in parts] for i in range(layers)
             for parts in FUSED_LAYER_TENSORS.get(arch, LAYER_TENSORS)]
    return names + [["output.weight" if "output.weight" in tensors else "token_embd.weight"]]


def check_shapes(source: GGUFFile, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int) -> None:
    """Each matrix tensor of a llama-family file has the shape its metadata's sizes give it; else one line naming the
    file and the tensor (a malformed file, which no runtime can run)."""
    arch = source.field("general.architecture")
    up = 2 * intermediate if arch in FUSED_LAYER_TENSORS else intermediate  # phi3's holds gate's rows too
    width = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
             "attn_v": (kv_heads * head_dim, hidden), "attn_qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
             "attn_output": (hidden, heads * head_dim), "ffn_gate": (intermediate, hidden), "ffn_up": (up, hidden),
             "ffn_down": (hidden, intermediate)}
    for parts in tensor_names(layers, source.tensors, arch):
        for name in parts:
            tensor = source.tensors[name]
            expected = width.get(name.split(".")[-2], (tensor.shape[0], hidden))
            if tuple(tensor.shape) != expected:
                raise UsageError(f"{source.path.name}: tensor {name} is {list(tensor.shape)}, where the file's "
                                 f"metadata makes it {list(expected)}")


def stored_q8(gguf: GGUFFile, names: list[str], weight: torch.Tensor, heads: int, kv_heads: int
              ) -> StoredMatrix | None:
    """The matrix the tensors ``names`` make, as stored, where each is in one of Q8_STORED's block formats and
    they hold ``weight`` [out, in] (the module's de-quantised copy) value for value, in the stored row order or with
    llama.cpp's q and k reordering undone; else None."""
    tensors = [gguf.tensors.get(name) for name in names]
    if any(t is None or t.type_name not in Q8_STORED for t in tensors):
        return None
    if sum(t.shape[0] for t in tensors) != weight.shape[0] or tensors[0].shape[1] != weight.shape[1]:
        return None
    for permuted in (False, True):
        matrix = _grid_matrix(tensors, _row_orders(names, [t.shape[0] for t in tensors], heads, kv_heads, permuted))
        if torch.equal(_grid_values(matrix), weight.detach().float()):
            return byte_grid(*matrix)
    return None


def _grid_matrix(tensors, orders) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, scale and offset of the tensors' rows in ``orders``, concatenated, on the finest of their groups."""
    group = min(grid_group(t.type_name) for t in tensors)
    parts = []
    for tensor, order in zip(tensors, orders):
        q, scale, offset = q8_rows(tensor)
        repeat = grid_group(tensor.type_name) // group  # a coarser grid's scale, once per finer group
        parts.append((q[order], np.repeat(scale[order], repeat, axis=1), np.repeat(offset[order], repeat, axis=1)))
    return tuple(torch.from_numpy(np.concatenate([part[j] for part in parts])) for j in range(3))


def packed_grid(tensors, orders, narrow: bool = False) -> StoredMatrix:
    """The tensors' rows in ``orders`` on the finest of their grids, packed :data:`CHUNK_ROWS` rows at a time into
    one buffer: the memory a matrix takes while it is packed is its packed size and a chunk's, where decoding it
    whole took several times its size (150k rows of an LM head). Every part but the last holds whole blocks of 8
    rows (``gguf_unavailable`` admits only heads of a multiple of 8 and sizes of a multiple of 32). ``narrow``, for
    integer products: tensors all kept in one of NARROW's formats are kept so, and tensors of several a part per
    format (:func:`_parts`)."""
    group = min(grid_group(t.type_name) for t in tensors)
    names = {NARROW.get(t.type_name) for t in tensors} if narrow else {None}
    if len(names) > 1 and (parts := _parts(tensors, orders)) is not None:
        return parts
    name = names.pop() if len(names) == 1 else None
    if name is not None and name.endswith("_k"):
        bits = int(name[3])
        return packed_chunks(tensors, orders, name,
                              lambda chunk, repeat: packed_k(*(None if t is None else torch.from_numpy(t)
                                                               for t in k_rows(chunk)), bits))
    bits = int(name[3]) if name is not None else 8
    name = name or ("int8" if group == 32 else "int8_group16")

    def grid(chunk: Tensor, repeat: int) -> torch.Tensor:
        q, scale, offset = q8_rows(chunk)
        return packed_q8(torch.from_numpy(q), torch.from_numpy(np.repeat(scale, repeat, axis=1)),
                         torch.from_numpy(np.repeat(offset, repeat, axis=1)), bits)

    return packed_chunks(tensors, orders, name, grid)


def _parts(tensors, orders) -> StoredMatrix | None:
    """A matrix of tensors of several narrow formats (a layer's q and k in Q4_K, its v in Q6_K) as a part per run
    of one format, each in its own bits (``StoredMatrix.rest``); None where one is not narrow or a part would end
    inside a block of 8 rows."""
    names = [NARROW.get(t.type_name) for t in tensors]
    if None in names:
        return None
    runs = [[0]]
    for i in range(1, len(tensors)):
        if names[i] == names[i - 1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    if any(sum(len(orders[i]) for i in run) % 8 for run in runs[:-1]):
        return None
    parts = [packed_grid([tensors[i] for i in run], [orders[i] for i in run], True) for run in runs]
    for part, following in zip(parts, parts[1:]):
        part.rest = following
    return parts[0]


def packed_chunks(tensors, orders, name: str, pack) -> StoredMatrix:
    """The matrix ``name`` of the tensors' rows in ``orders``, each chunk of rows packed by ``pack(chunk, repeat)``
    (repeat: how many of the finest grid's groups one of the tensor's scales covers) into one buffer."""
    group = min(grid_group(t.type_name) for t in tensors)
    inputs, rows = tensors[0].shape[1], sum(len(order) for order in orders)
    assert all(len(order) % 8 == 0 for order in orders[:-1]), "a part ends inside a block of 8 rows"
    packed = torch.empty(-(-rows // 8) * group_bytes(name, inputs), dtype=torch.uint8)
    at = 0
    for tensor, order in zip(tensors, orders):
        repeat = grid_group(tensor.type_name) // group  # a coarser grid's scale, once per finer group
        for start in range(0, len(order), CHUNK_ROWS):
            chunk = order[start : start + CHUNK_ROWS]
            piece = pack(Tensor(tensor.name, tensor.type_name, (len(chunk), inputs), tensor.data[chunk]), repeat)
            packed[at : at + len(piece)] = piece
            at += len(piece)
    return StoredMatrix(name, rows, inputs, packed)


def _grid_values(matrix) -> torch.Tensor:  # [out, in] float32
    q, scale, offset = matrix
    group = q.shape[1] // scale.shape[1]
    return (q.view(q.shape[0], -1, group).float() * scale[..., None] + offset[..., None]).view(q.shape)


def _row_orders(names: list[str], rows: list[int], heads: int, kv_heads: int, permuted: bool
                ) -> list[np.ndarray]:
    """Per tensor, the stored row that holds each of the module's rows: as stored, or (``permuted``) with
    llama.cpp's q and k reordering undone."""
    def order(name: str, n: int) -> np.ndarray:
        if permuted and (".attn_q." in name or ".attn_k." in name):
            return _unpermuted(n, heads if ".attn_q." in name else kv_heads)
        return np.arange(n)

    return [order(name, n) for name, n in zip(names, rows)]


def _unpermuted(rows: int, heads: int) -> np.ndarray:
    """The stored row that holds each of the module's rows, where llama.cpp's converter wrote each head's rows as
    its two rotary halves interleaved (``permute`` in convert_hf_to_gguf.py)."""
    written = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)  # stored <- module
    return np.argsort(written)


def module_blocks(matrices: list[torch.Tensor], source: GGUFFile, config) -> list[StoredMatrix | None]:
    """Per fused.c matrix of a module converted from ``source``: that matrix as stored, or None."""
    names = tensor_names(config.num_hidden_layers, source.tensors)
    return [stored_q8(source, parts, matrix, config.num_attention_heads, config.num_key_value_heads)
            for parts, matrix in zip(names, matrices)]


def packed_matrices(source: GGUFFile, layers: int, heads: int, kv_heads: int, narrow: bool = False
                    ) -> Iterator[StoredMatrix]:
    """Each fused.c matrix as the file stores it, in the module's row order, repacked one at a time (their biases:
    :func:`gguf_matrices`), the file's pages let go after each; ``narrow``: 4-bit and 6-bit formats in their bits
    (:func:`packed_grid`)."""
    for _, tensors, orders in matrix_rows(source, layers, heads, kv_heads):
        yield _stored(tensors, orders, narrow)
        source.release()


def gguf_matrices(source: GGUFFile, layers: int, heads: int, kv_heads: int, packed: list[StoredMatrix]
                  ) -> list[StoredMatrix]:
    """The matrices :func:`packed_matrices` gives (or their copy kept in exactspec's cache, ``packed_file.py``), each
    with its bias (qwen2's q, k and v) in the module's row order."""
    for matrix, (parts, _, orders) in zip(packed, matrix_rows(source, layers, heads, kv_heads)):
        matrix.bias = _bias(source, parts, orders)
    return packed


def matrix_rows(source: GGUFFile, layers: int, heads: int, kv_heads: int
                 ) -> Iterator[tuple[list[str], list[Tensor], list[np.ndarray]]]:
    """Per fused.c matrix: its GGUF tensors' names, the tensors, and per tensor the stored row of each module row."""
    arch = source.field("general.architecture")
    permuted = arch in PERMUTED_ARCHITECTURES
    for parts in tensor_names(layers, source.tensors, arch):
        tensors = [source.tensors[name] for name in parts]
        yield parts, tensors, _row_orders(parts, [t.shape[0] for t in tensors], heads, kv_heads, permuted)


def _stored(tensors, orders, narrow: bool) -> StoredMatrix:
    types = {t.type_name for t in tensors}
    if types <= set(Q8_STORED):
        return packed_grid(tensors, orders, narrow)
    values = torch.from_numpy(np.concatenate([dequantized(t).reshape(t.shape[0], -1)[order]
                                              for t, order in zip(tensors, orders)]))
    precision = FLOAT_STORED.get(types.pop()) if len(types) == 1 else None
    return float_matrix(values, precision or "float32")  # float16 and bfloat16 values are exact in their type


def _bias(source: GGUFFile, names: list[str], orders: list[np.ndarray]) -> torch.Tensor | None:
    """The tensors' biases (``.bias`` beside ``.weight``) in the rows' order, zeros for one without; None if none
    has one."""
    biases = [source.tensors.get(name.replace(".weight", ".bias")) for name in names]
    if all(b is None for b in biases):
        return None
    return torch.from_numpy(np.concatenate([
        dequantized(b)[order] if b is not None else np.zeros(len(order), dtype=np.float32)
        for b, order in zip(biases, orders)]).astype(np.float32))
